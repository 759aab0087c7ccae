"""The dashboard's read model: what the built-in web dashboard needs beyond the read API (runs/,
detect/routes.py): a runs overview with health and pace, a ranks x steps heatmap, amax per module."""
