# Opens sockets to the outside: UDP and TCP to a port the test listens on, a raw socket, IPv6,
# netlink, a Unix socket at a path the test listens on, and an abstract Unix socket.
import json
import socket

PORT, UNIX_PATH, ABSTRACT = int("@PORT@"), "@UNIX_PATH@", "@ABSTRACT@"
seen = {}


def attempt(name, fn):
    try:
        fn()
        seen[name] = "ok"
    except OSError as e:
        seen[name] = e.strerror or str(e)


attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"pwned", ("127.0.0.1", PORT)))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2).send(b"pwned"))
attempt("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt("ipv6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))


def unix(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(address)
    s.send(b"pwned")


attempt("unix_path", lambda: unix(UNIX_PATH))
attempt("unix_abstract", lambda: unix("\0" + ABSTRACT))
raise RuntimeError("REPORT " + json.dumps(seen))
