"""The RL / MOPD loop across roles: inputs, exchange, records, the program."""
