"""What the driver and the nodes both speak: the job folder's keys and sealed documents, the pickled payload and result envelopes, the versions a node reports.

Below both sides: the driver (``driver/``, ``compute/``) and the nodes (``launch/``) import it, it imports neither."""
