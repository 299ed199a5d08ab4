"""The planner: device and model catalog (catalog.py), the roofline cost model (roofline.py), cluster files (cluster_file.py,
cluster_nodes.py), calibration (calibration.py: every measured row fitted together), configurations and the plan
(configurations.py, plan.py), a loaded server's throughput in closed form (loaded.py), and serving under load (servesim.py,
serving.py).

May import: tinyhet.config only (it is pure arithmetic: no device, no model code)."""
