"""The `tinyhet` command (main.py) and one module per subcommand: run (and the resident process that keeps its model
loaded), node, serve, plan, info; `bench` is tinyhet.bench. What the subcommands share is in common.py.

May import: anything."""
