"""The turn parser that serving shares and `raychat chat`, the terminal chat."""
