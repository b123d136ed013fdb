"""Wire formats shared by weight senders (``rollsafe.transports``) and receivers (the reference
engine): imports only torch. :mod:`rollsafe.wire.shm` owns the shared-memory namespace CPU
buckets travel in."""
