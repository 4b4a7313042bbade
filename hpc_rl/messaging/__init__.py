"""What moves between the ranks of a step, below the roles and the loop that both use it:
the routes (who feeds whom), the messages, and pickled point-to-point transfer."""
