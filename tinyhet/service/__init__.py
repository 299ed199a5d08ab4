"""The cluster service: the router (router.py), its OpenAI HTTP API (http_api.py, api_schema.py) and metrics, heartbeats,
the prefill and `both` roles of a node (prefill_node.py, node_roles.py), and nodes placed by Ray (ray_cluster.py).

May import: everything below it (tinyhet.config, device, model, kv, engine) and tinyhet.planner."""
