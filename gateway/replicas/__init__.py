"""One gateway on many processes and hosts: each process is a replica that holds the run state as the store
has it, heartbeats, and (one of them) publishes what the health checks find."""
