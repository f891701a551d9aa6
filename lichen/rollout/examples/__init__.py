"""Example plug-ins for lichen's rollout (see each module's docstring for its flag)."""
