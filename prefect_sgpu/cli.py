"""``prefect-sgpu``: the command line.

    prefect-sgpu --version
    prefect-sgpu gpus [--region REGION] [--json]
    prefect-sgpu run [--gpus N] [--nodes N] [--gpu-type TYPE] [--remote --compute-block SLUG/NAME] SCRIPT [ARGS]
    prefect-sgpu gc [--dry-run] [--compute-block SLUG/NAME | --store URI] [options]
    prefect-sgpu doctor [--compute-block SLUG/NAME | --store s3://... --region R] [--gpu-type T --gpus N --nodes N]
    prefect-sgpu setup aws (--store s3://... | --compute-block SLUG/NAME) [--instance-profile NAME] [--dry-run]

``gpus`` prints the accelerator catalog (:mod:`prefect_sgpu.catalog`): each GPU type, the
instance types that carry it, their GPUs per node and on-demand price per hour where the
catalog has one for ``--region``.

``run`` launches a script on every rank as torchrun does, inside a Prefect flow run named
``prefect-sgpu-run`` (:mod:`prefect_sgpu.adapters.script_run`): GPU quota, events, artifacts and
rank logs are those of a ``@gpu_task``. Exit status 0 when every rank exited 0, 1 when the job
failed, 2 for bad arguments (nothing was started).

``doctor`` checks what a first EC2 job needs against the account (:mod:`prefect_sgpu.compute.ec2.doctor`):
credentials, region, the store bucket, the image, the instance type's offering and vCPU quota, a
capacity reservation, the driver policy simulated against the driver's identity, and what a
launch meets after the API accepted it (security group, EBS key, subnet addresses, a shared
profile's role, a job role's key, the first attempt with ``DryRun``). Exit status 0 when nothing
failed, 1 when a check failed (each says what to do), 2 for bad arguments.

``setup aws`` creates or checks what one store needs (:mod:`prefect_sgpu.compute.ec2.setup`): the
bucket with encryption, Bucket Keys and a lifecycle rule, the node boundary, the driver and doctor
policies, a shared instance profile if asked; it reports the network it finds. A second run changes
nothing; ``--dry-run`` prints every call and makes none. Exit status 0, 1 when a call failed, 2 for
bad arguments.

``gc`` removes what dead drivers left behind (:mod:`prefect_sgpu.compute.remote.sweep`): with
``--compute-block`` the store, region and credentials of a saved compute block; with
``--store s3://...`` that store and the EC2 resources of its runs in ``--region``;
with ``--store /folder`` or nothing, a local job store. Exit status 0 when the pass
finished, 1 when part of it failed (it says which), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: EC2Compute's default ttl_minutes, in seconds: runs whose resources do not say their TTL
EC2_DEFAULT_TTL_S = 15 * 60.0


def _parser() -> argparse.ArgumentParser:
    from prefect_sgpu import __version__

    parser = argparse.ArgumentParser(prog="prefect-sgpu", description="prefect-sgpu command line")
    parser.add_argument("--version", action="version", version=f"prefect-sgpu {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    gpus = commands.add_parser("gpus", help="the GPU catalog: GPU types, instance types, GPUs per node, "
                                            "hourly prices")
    gpus.add_argument("--region", default=None,
                      help="AWS region of the prices (default: the one the catalog has prices for)")
    gpus.add_argument("--json", action="store_true", help="print the catalog as JSON")
    run = commands.add_parser(
        "run", help="run a Python script on every rank, as torchrun does, inside a Prefect flow run",
        description="Options of prefect-sgpu come before the script; everything after it is the script's own.")
    run.add_argument("--gpus", type=int, default=None, help="ranks in all (one per GPU; CPU processes on a "
                                                            "machine without GPUs); default 1")
    run.add_argument("--nodes", type=int, default=None, help="machines the ranks are spread over (default: "
                                                             "as few as hold them)")
    run.add_argument("--timeout", type=float, default=None, help="seconds the whole job may take")
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                     help="an environment variable of every rank (repeatable)")
    add_gpu_arguments(run)
    run.add_argument("script", help="the Python script (*.py)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    gc = commands.add_parser("gc", help="remove what dead drivers left: instances, groups, SSM keys, control "
                                        "files, RUNNING MLflow runs")
    where = gc.add_mutually_exclusive_group()
    where.add_argument("--compute-block", metavar="SLUG/NAME",
                       help="a saved compute block, e.g. sgpu-ec2-compute/h100-pool")
    where.add_argument("--store", metavar="URI", help="an s3://bucket/prefix or a local job folder "
                                                      "(default: $PREFECT_SGPU_HOME/jobs)")
    gc.add_argument("--region", help="AWS region of an s3:// store's instances (default: the AWS config's)")
    gc.add_argument("--endpoint-url", help="a custom AWS endpoint (private links, tests)")
    gc.add_argument("--ttl-seconds", type=float, help="heartbeat TTL of runs whose resources do not carry "
                                                      "sgpu:heartbeat-ttl (default: the compute's)")
    gc.add_argument("--grace-seconds", type=float, default=None, help="added to a run's TTL before it counts as "
                                                                      "dead (default: 60, or half the TTL if less)")
    gc.add_argument("--tracking-uri", help="MLflow tracking URI whose RUNNING runs of dead jobs end KILLED "
                                           "(default: MLFLOW_TRACKING_URI or prefect-sgpu's own store)")
    gc.add_argument("--no-mlflow", action="store_true", help="leave MLflow runs alone")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    gc.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor = commands.add_parser("doctor", help="check what a first EC2 job needs: credentials, store, image, "
                                                "GPU quota, driver policy")
    source = doctor.add_mutually_exclusive_group()
    source.add_argument("--compute-block", metavar="SLUG/NAME",
                        help="a saved EC2 compute block, e.g. sgpu-ec2-compute/h100-pool (its settings and credentials)")
    source.add_argument("--store", metavar="URI", help="the s3://bucket/prefix nodes exchange files through")
    doctor.add_argument("--region", help="AWS region (default: the AWS config's; with --compute-block, the block's)")
    doctor.add_argument("--market", choices=("spot", "on-demand", "reserved"), help="the quota to check (default: "
                                                                                   "the block's, else on-demand)")
    doctor.add_argument("--ami-id", help="the image to check (default: the block's, else the one its SSM "
                                         "parameter names)")
    doctor.add_argument("--endpoint-url", help="a custom AWS endpoint (private links, tests)")
    doctor.add_argument("--gpu-type", metavar="TYPE", help="check the instance type and vCPU quota for this GPU type")
    doctor.add_argument("--gpus", type=int, help="GPUs of the job (default: one node's)")
    doctor.add_argument("--nodes", type=int, help="nodes of the job (default: as few as hold --gpus)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    setup = commands.add_parser("setup", help="create or check what a cloud account needs for one store")
    clouds = setup.add_subparsers(dest="cloud", required=True)
    setup_aws = clouds.add_parser(
        "aws", help="the bucket (encryption, Bucket Keys, a lifecycle rule), the node boundary, the driver and "
                    "doctor policies, a shared instance profile if asked; reports the network it finds")
    where = setup_aws.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", metavar="URI", help="the s3://bucket/prefix nodes exchange files through")
    where.add_argument("--compute-block", metavar="SLUG/NAME", help="a saved EC2 compute block (its store, "
                                                                     "region, KMS key and credentials)")
    setup_aws.add_argument("--region", help="AWS region (default: the block's, else the AWS config's)")
    setup_aws.add_argument("--endpoint-url", help="a custom AWS endpoint (private links, tests)")
    setup_aws.add_argument("--kms-key-id", help="the store's KMS key (default encryption SSE-KMS under it; "
                                                "default: the block's, else SSE-S3)")
    setup_aws.add_argument("--instance-profile", metavar="NAME", help="also create a shared instance profile (and "
                                                                      "its role) of this name")
    setup_aws.add_argument("--abort-incomplete-uploads-days", type=int, default=7, metavar="N",
                           help="days after which incomplete multipart uploads under the store are aborted "
                                "(default 7)")
    setup_aws.add_argument("--name-suffix", default="", help="added to the managed policies' names (a second "
                                                              "store of one account)")
    setup_aws.add_argument("--dry-run", action="store_true", help="print every call it would make; make none")
    setup_aws.add_argument("--json", action="store_true", help="print the outcome as JSON")
    return parser


def _setup_aws(args: argparse.Namespace) -> int:
    from prefect_sgpu.compute.ec2 import setup
    from prefect_sgpu.errors import SGPUConfigError

    session, kms_key_id, region = None, args.kms_key_id, args.region
    store = args.store
    if args.compute_block:
        from prefect.blocks.core import Block

        from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute

        compute = Block.load(args.compute_block).get_compute()
        if not isinstance(compute, EC2InstanceCompute):
            raise SGPUConfigError("--compute-block", args.compute_block, "an EC2 compute block")
        store, region = compute.settings.store_uri, region or compute.settings.region
        kms_key_id = kms_key_id or compute.settings.kms_key_id
        session = compute.provisioner._session
    made = setup.AWSSetup(store, region or _default_region(), session=session, endpoint_url=args.endpoint_url,
                          instance_profile=args.instance_profile, kms_key_id=kms_key_id,
                          abort_after_days=args.abort_incomplete_uploads_days, dry_run=args.dry_run,
                          name_suffix=args.name_suffix)
    try:
        outcome = made.run()
    except SGPUConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - say what failed and what was done before it
        from prefect_sgpu.aws import error_of

        code, message = error_of(exc)
        print(setup.report(made.outcome, args.dry_run), file=sys.stderr)
        print(f"prefect-sgpu setup aws: {made.outcome.calls[-1] if made.outcome.calls else 'the first call'} "
              f"failed: {code or type(exc).__name__}: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(outcome.as_json(), indent=2))
    else:
        print(setup.report(outcome, args.dry_run))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from prefect_sgpu.compute.ec2 import doctor
    from prefect_sgpu.compute.ec2.settings import EC2Settings
    from prefect_sgpu.errors import SGPUConfigError

    wanted = doctor.Wanted.of(args.gpu_type, args.gpus, args.nodes)
    session = None
    builds_on_nodes = None
    if args.compute_block:
        from prefect.blocks.core import Block

        from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute

        compute = Block.load(args.compute_block).get_compute()
        if not isinstance(compute, EC2InstanceCompute):
            raise SGPUConfigError("--compute-block", args.compute_block, "an EC2 compute block")
        changes = {k: v for k, v in (("region", args.region), ("market", args.market), ("ami_id", args.ami_id),
                                     ("endpoint_url", args.endpoint_url)) if v}
        settings = compute.settings.model_copy(update=changes) if changes else compute.settings
        session = compute.provisioner._session
        options = getattr(compute, "sgpu_environment", None)
        builds_on_nodes = None if options is None else options.mode != "image"
    else:
        fields = {"region": args.region or _default_region(), "store_uri": args.store or "",
                  "market": args.market or "on-demand", "endpoint_url": args.endpoint_url, "ami_id": args.ami_id}
        settings = EC2Settings(**{k: v for k, v in fields.items() if v is not None})
    checks = doctor.examine(settings, wanted, session=session, builds_on_nodes=builds_on_nodes)
    if args.json:
        print(json.dumps(doctor.as_json(checks), indent=2))
    else:
        print(doctor.report(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


def _sweeper(args: argparse.Namespace) -> Any:
    from prefect_sgpu.compute.remote.sweep import Sweeper, sweeper

    tracking_uri = None
    if not args.no_mlflow:
        from prefect_sgpu.observe.tracking import default_tracking_uri, mlflow_available

        tracking_uri = args.tracking_uri or (default_tracking_uri() if mlflow_available() else None)
    options: dict[str, Any] = {"grace_s": args.grace_seconds}
    if args.ttl_seconds is not None:
        options["ttl_s"] = args.ttl_seconds
    if args.compute_block:
        from prefect.blocks.core import Block

        compute = Block.load(args.compute_block).get_compute()
        made = sweeper(compute, None, tracking_uri, **options)
        if args.ttl_seconds is not None:
            made.ttl_s = args.ttl_seconds
        return made
    if args.store and args.store.startswith("s3://"):
        from prefect_sgpu.compute.ec2.instances import EC2Provisioner
        from prefect_sgpu.compute.ec2.settings import EC2Settings
        from prefect_sgpu.store.s3 import S3Store

        region = args.region or _default_region()
        settings = EC2Settings(region=region, endpoint_url=args.endpoint_url)
        store = S3Store(args.store, region=region, endpoint_url=args.endpoint_url)
        options.setdefault("ttl_s", EC2_DEFAULT_TTL_S)
        return Sweeper(store, cloud=EC2Provisioner(settings), tracking_uri=tracking_uri, **options)
    from prefect_sgpu.store import LocalStore

    return sweeper(None, LocalStore(args.store) if args.store else None, tracking_uri, **options)


def _run(args: argparse.Namespace) -> int:
    """The script's job in a flow run: 0 when every rank exited 0, 1 when the job failed (its error
    printed), 2 for bad arguments (SGPUConfigError, raised to :func:`main` before anything starts)."""
    from prefect_sgpu.errors import SGPUConfigError

    given: dict[str, Any] = {k: v for k, v in (("gpus", args.gpus), ("nodes", args.nodes),
                                               ("timeout", args.timeout)) if v is not None}
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SGPUConfigError("--env", item, "KEY=VALUE")
        env[key] = value
    if env:
        given["env"] = env
    given.update({k: v for k, v in gpu_options(args).items() if v})
    from prefect_sgpu.adapters import script_run

    try:
        script_run.run(args.script, args.script_args, given)
    except SGPUConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the job failed: the flow run and the rank logs say how
        print(f"prefect-sgpu run: {args.script} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _default_region() -> str:
    import boto3

    return boto3.session.Session().region_name or "us-east-1"


def _gpus(args: argparse.Namespace) -> int:
    from prefect_sgpu import catalog
    from prefect_sgpu.compute.ec2.settings import check_region

    region = catalog.PRICE_REGION if args.region is None else check_region(args.region)
    described = catalog.describe(region)
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    priced = region in described["priced_regions"]
    print(f"GPU types and the EC2 instances that carry them; on-demand USD per hour in {region}" if priced else
          f"GPU types and the EC2 instances that carry them; the catalog has no prices for {region} "
          f"(it has {', '.join(described['priced_regions'])})")
    header = ("GPU", "instance type", "GPUs/node", "vCPUs", "memory GiB", "GPU memory GiB", "EFA",
              "USD/hour", "USD/GPU-hour")
    rows = [header]
    for gpu in described["gpu_types"]:
        label = gpu["name"] + (f" ({', '.join(gpu['aliases'])})" if gpu["aliases"] else "")
        for it in gpu["instance_types"]:
            rows.append((label, it["name"], str(it["gpus"]), str(it["vcpus"]), str(it["memory_gib"]),
                         str(it["gpu_memory_gib"]), str(it["efa_interfaces"]),
                         "-" if it["usd_per_hour"] is None else f"{it['usd_per_hour']:.3f}",
                         "-" if it["usd_per_gpu_hour"] is None else f"{it['usd_per_gpu_hour']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from prefect_sgpu.errors import SGPUConfigError

    try:
        if args.command == "gpus":
            return _gpus(args)
        if args.command == "run":
            return _run(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "setup":
            return _setup_aws(args)
        made = _sweeper(args)
    except SGPUConfigError as exc:
        print(f"prefect-sgpu {args.command}: {exc}", file=sys.stderr)
        return 2
    report = made.sweep(dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(f"store {made.store.root_uri}" + (" (dry run)" if args.dry_run else ""))
        for line in report.lines():
            print(f"  {line}")
    return 1 if report.errors else 0


# --- the example flows' command lines ---------------------------------------------------


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu-type``, ``--remote`` and ``--compute-block``, as the example flows take them."""
    group = parser.add_argument_group("where the GPU tasks run")
    group.add_argument("--gpu-type", metavar="TYPE", help="an accelerator of the catalog (A10, L4, A100, H100, "
                                                          "...); default: whatever this machine has")
    group.add_argument("--remote", action="store_true",
                       help="run the GPU tasks on other machines: needs --compute-block or "
                            "$PREFECT_SGPU_REMOTE_COMPUTE")
    group.add_argument("--compute-block", metavar="SLUG/NAME",
                       help="a saved compute block for remote GPU tasks, e.g. sgpu-ec2-compute/h100-pool")


def gpu_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flow's ``gpu_type`` and ``remote`` from :func:`add_gpu_arguments`, checked before the flow starts.

    ``--compute-block`` becomes ``$PREFECT_SGPU_REMOTE_COMPUTE`` for this process (and so the flow's GPU tasks).
    """
    import os

    from prefect_sgpu.errors import SGPUConfigError
    from prefect_sgpu.resolve import REMOTE_COMPUTE_ENV

    if args.gpu_type is not None:
        from prefect_sgpu.catalog import known_gpu_types, lookup

        try:
            lookup(args.gpu_type)
        except SGPUConfigError:
            raise SGPUConfigError("--gpu-type", args.gpu_type, "one of " + ", ".join(known_gpu_types())) from None
    if args.compute_block:
        if args.compute_block.count("/") != 1 or not all(args.compute_block.split("/")):
            raise SGPUConfigError("--compute-block", args.compute_block, "a saved block's '<block-type-slug>/<name>'")
        if not args.remote:
            raise SGPUConfigError("--compute-block", args.compute_block, "only with --remote")
        os.environ[REMOTE_COMPUTE_ENV] = args.compute_block
    elif args.remote and not os.environ.get(REMOTE_COMPUTE_ENV):
        raise SGPUConfigError("--remote", True, "only with a remote compute",
                              f"pass --compute-block SLUG/NAME or set {REMOTE_COMPUTE_ENV}")
    return {"gpu_type": args.gpu_type, "remote": bool(args.remote)}


if __name__ == "__main__":
    sys.exit(main())
