"""`loongforge serve`: a trained policy behind Isaac-GR00T's policy-server protocol (protocol.py is the
wire format; server.py the socket loop; backend.py what is served; client.py a client for users without
Isaac-GR00T)."""
