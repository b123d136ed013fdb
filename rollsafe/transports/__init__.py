"""Weight transports: move a trainer's weights into rollout engines (ipc, nccl, checkpoint_engine, disk)."""
