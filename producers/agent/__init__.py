"""The host agent: lives beside or inside the training process (PyTorch hook, hardware sampler,
host-side summariser, spool) and publishes heartbeats and feature batches."""
