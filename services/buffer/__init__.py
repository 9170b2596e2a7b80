"""The buffer service: put / get / get_metrics, prompt release, staleness, recycling."""
