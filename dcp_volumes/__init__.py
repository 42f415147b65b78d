"""dcp_volumes: PyTorch Distributed Checkpoint on object storage."""
