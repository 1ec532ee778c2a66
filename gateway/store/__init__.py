"""The durable store: schema, token packing, group-commit writer and reads."""
