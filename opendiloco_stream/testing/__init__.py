"""Hooks for tests and benchmarks only (fault injection); nothing here is a setting users see."""
