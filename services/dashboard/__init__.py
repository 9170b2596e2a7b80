"""The run dashboard and `asyncrl status` (services/dashboard/app.py, status.py)."""
