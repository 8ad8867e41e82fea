"""Multi-turn episodes: environments, the tools a policy calls, the sandbox that runs code."""
