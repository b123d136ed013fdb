"""Weight transports: move a trainer's weights into engines (ipc, nccl, checkpoint_engine, disk)."""
