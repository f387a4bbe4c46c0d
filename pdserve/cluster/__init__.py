"""Running pools of instances: on this machine as child processes (local.py), or as Ray actors over many
nodes (ray.py), resized by hand or by the autoscaler."""
