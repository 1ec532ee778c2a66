"""The store of rollouts every part reads: its tables, database, packed ids, the delta rebuild, the statuses.

The gateway writes through it, `training_data` and `trainer_client` read through it; it imports none of them,
so a trainer's reads depend on the store's format alone, never on the gateway's code.
"""
