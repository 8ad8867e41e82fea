"""Where rewards come from: the reward-source interface (interface.py) and the one source a run uses
(source.py), chosen from reward functions, verifiers, code tests, a reward model, a generative judge or a
reward server over HTTP (remote.py), and that server (server.py, `ppo-serve-reward`)."""
