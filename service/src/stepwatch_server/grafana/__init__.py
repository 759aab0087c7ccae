"""Grafana: the dashboards as code (`python -m stepwatch_server.grafana.generate` writes dashboards/),
their provisioning, and `stepwatch-server grafana push` (grafana/push.py)."""
