"""One job from start to finish on the driver: plan, acquire, start, watch, recover, release."""
