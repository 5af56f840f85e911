"""Connects once (a virtual connection under the layer), then makes a non-blocking connect to
the same address, which nothing listens on any more, and prints what each call says:
SO_ERROR, three sends, one receive (what native TCP says: ECONNREFUSED, EPIPE, end of
stream)."""
import errno
import select
import socket
import sys
import time

host, port = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((host, port))
s.sendall(b"x")
assert s.recv(1) == b"y"
s.close()
time.sleep(1.0)
s = socket.socket()
s.setblocking(False)
try:
    s.connect((host, port))
except BlockingIOError:
    pass
select.select([], [s], [], 5)
out = ["so_error=" + errno.errorcode.get(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), "0")]
for _ in range(3):
    try:
        out.append("send=%d" % s.send(b"hello"))
    except OSError as e:
        out.append("send=" + errno.errorcode.get(e.errno, str(e.errno)))
    time.sleep(0.1)
try:
    out.append("recv=%r" % s.recv(10))
except OSError as e:
    out.append("recv=" + errno.errorcode.get(e.errno, str(e.errno)))
print(" ".join(out), flush=True)
