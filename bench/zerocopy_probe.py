#!/usr/bin/env python3
"""Can MSG_ZEROCOPY avoid a copy in this lab? Sends 200 × 64 KiB with
MSG_ZEROCOPY from host1 to host2 over nic1 (a veth pair into a switch
namespace), and over loopback, and counts the kernel's completions by
`ee_code`: 0 = sent from the caller's pages, 1 (SO_EE_CODE_ZEROCOPY_COPIED) =
the kernel copied anyway. Needs a lab up (`ferry lab up --hosts 2`).

    sudo python3 bench/zerocopy_probe.py
"""
import ast, socket, struct, subprocess, sys, time

SO_ZEROCOPY, MSG_ZEROCOPY, PORT = 60, 0x4000000, 5002


def serve():
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("0.0.0.0", PORT))
    l.listen()
    c, _ = l.accept()
    while c.recv(1 << 20):
        pass


def send(addr):
    s = socket.socket()
    for _ in range(50):
        try:
            s.connect((addr, PORT))
            break
        except OSError:
            time.sleep(0.1)
    s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    buf = b"z" * (1 << 16)
    for _ in range(200):
        s.send(buf, MSG_ZEROCOPY)
    time.sleep(0.5)
    codes = {}
    while True:
        try:
            _, anc, _, _ = s.recvmsg(0, 4096, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        for _, _, data in anc:
            _, _, _, code, _, lo, hi = struct.unpack("=IBBBBII", data[:16])
            codes[code] = codes.get(code, 0) + hi - lo + 1
    s.close()
    return codes


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve()
    if len(sys.argv) > 1 and sys.argv[1] == "send":
        print(send(sys.argv[2]))
        return
    print("| path | sends completed without a copy | sends the kernel copied |")
    print("|---|---|---|")
    from labqemu import lab_addr
    for label, srv_ns, cli_ns, addr in (("host1 nic1 → host2 (veth, namespaces)", "host2", "host1", lab_addr("host2", 1)),
                                        ("loopback", None, None, "127.0.0.1")):
        wrap = lambda ns: ["ip", "netns", "exec", ns] if ns else []
        srv = subprocess.Popen(wrap(srv_ns) + [sys.executable, __file__, "serve"])
        out = subprocess.run(wrap(cli_ns) + [sys.executable, __file__, "send", addr],
                             capture_output=True, text=True).stdout
        srv.wait(timeout=10)
        codes = ast.literal_eval(out.strip() or "{}")
        print(f"| {label} | {codes.get(0, 0)} | {codes.get(1, 0)} |")


if __name__ == "__main__":
    main()
