"""The worker as a Ray actor: the actor and its asyncio wrapper around the engine."""
