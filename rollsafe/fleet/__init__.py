"""Fleet control: registry, router, health manager, recovery and sync coordinators."""
