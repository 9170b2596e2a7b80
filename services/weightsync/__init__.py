"""Weight-sync: moves the engines to each published weight version."""
