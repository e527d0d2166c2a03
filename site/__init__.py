"""The web dashboard's files (static/: plain HTML, CSS and JS, no CDN) and the Grafana dashboard
for rgpu's Prometheus metrics (grafana/). rgpu-poold serves static/ (remoting/pool/dashboard.py)."""
