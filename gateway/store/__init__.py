"""The gateway's side of the store: the group-commit writer and its reads, over `rollout_store`'s tables."""
