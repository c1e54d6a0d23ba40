"""The scheduler: queues runs by class and tenant weight, dispatches them to workers."""
