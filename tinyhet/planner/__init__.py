"""The planner: device and model catalog (catalog.py), the roofline cost model (roofline.py), cluster files (cluster_file.py,
cluster_nodes.py), configurations and the plan (configurations.py, plan.py), and serving under load (servesim.py, serving.py).

May import: tinyhet.config only (it is pure arithmetic: no device, no model code)."""
