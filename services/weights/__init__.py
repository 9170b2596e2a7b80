"""The weight store: weight snapshots in a JetStream object bucket, for engines that share no disk with
the trainer (store.py)."""
