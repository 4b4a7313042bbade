"""Fault tolerance helpers the RL loop calls: save-on-signal and stop-for-requeue."""
