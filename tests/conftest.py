"""Shared fixtures. Keep expensive ones (model loads, Ray clusters, redis) session/module scoped."""
