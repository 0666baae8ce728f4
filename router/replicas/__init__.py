"""High availability on NATS: replica sync of bookings (`sync`) and durable events with index
snapshots (`durable`). See README.md here."""
