"""RSS per initialized legacy session of the gateway, with or without its held standalone
stream (one upstream connection each): the U term of docs/operations.md's memory formula.

    python3 bench/held-stream-rss.py N true|false [binary]

Starts a minimal stateful upstream (JSON initialize, SSE GETs held open), the gateway in front
of it on loopback, initializes N sessions one after another, and prints the RSS growth per
session and the gateway's held-stream and upstream-connection gauges.
"""
import asyncio, json, subprocess, sys, socket, re, os
N=int(sys.argv[1]); HOLD=sys.argv[2]
BIN=sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(__file__), "..", "target", "debug", "mcp-reattach")
async def upstream(reader, writer):
    n=0
    try:
        while True:
            head=await reader.readuntil(b"\r\n\r\n")
            lines=head.decode().split("\r\n"); method=lines[0].split()[0]
            h={l.split(":",1)[0].lower():l.split(":",1)[1].strip() for l in lines[1:] if ":" in l}
            body=b""
            if "content-length" in h: body=await reader.readexactly(int(h["content-length"]))
            if method=="GET":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"); await writer.drain()
                await asyncio.sleep(3600)
                return
            msg=json.loads(body or b"{}")
            if msg.get("method")=="initialize":
                upstream.count+=1
                r=json.dumps({"jsonrpc":"2.0","id":msg["id"],"result":{"protocolVersion":"2025-06-18","capabilities":{},"serverInfo":{"name":"m","version":"0"}}}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nmcp-session-id: s%d\r\ncontent-length: %d\r\n\r\n"%(upstream.count,len(r))+r)
            else:
                writer.write(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (Exception, asyncio.CancelledError): pass
upstream.count=0
def rss(pid):
    return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1))*1024
def req(port, body, sid=None):
    s=socket.create_connection(("127.0.0.1",port))
    hdr=f"POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\naccept: application/json, text/event-stream\r\ncontent-length: {len(body)}\r\nconnection: close\r\n"
    if sid: hdr+=f"mcp-session-id: {sid}\r\n"
    s.sendall((hdr+"\r\n").encode()+body.encode())
    data=b""
    while True:
        c=s.recv(65536)
        if not c: break
        data+=c
    s.close()
    m=re.search(rb"mcp-session-id: (\S+)", data, re.I)
    return m.group(1).decode() if m else None
async def main():
    srv=await asyncio.start_server(upstream,"127.0.0.1",0)
    up=srv.sockets[0].getsockname()[1]
    lp=socket.socket(); lp.bind(("127.0.0.1",0)); port=lp.getsockname()[1]; lp.close()
    ap=socket.socket(); ap.bind(("127.0.0.1",0)); aport=ap.getsockname()[1]; ap.close()
    p=subprocess.Popen([BIN,"--upstream",f"http://127.0.0.1:{up}","--listen",f"127.0.0.1:{port}","--admin-listen",f"127.0.0.1:{aport}","--hold-standalone",HOLD,"--log-level","warn"],stdout=subprocess.DEVNULL)
    await asyncio.sleep(1.0)
    base=rss(p.pid)
    loop=asyncio.get_running_loop()
    init='{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}'
    note='{"jsonrpc":"2.0","method":"notifications/initialized"}'
    for i in range(N):
        sid=await loop.run_in_executor(None, req, port, init)
        await loop.run_in_executor(None, req, port, note, sid)
    await asyncio.sleep(2.0)
    after=rss(p.pid)
    m=await loop.run_in_executor(None, lambda: __import__("urllib.request").request.urlopen(f"http://127.0.0.1:{aport}/metrics").read().decode())
    held=re.search(r"^mcp_reattach_held_standalone_streams (\d+)", m, re.M).group(1)
    upc=re.search(r"^mcp_reattach_upstream_connections (\d+)", m, re.M).group(1)
    print(f"hold={HOLD} N={N} base={base/1024:.0f}KiB after={after/1024:.0f}KiB per_session={(after-base)/N:.0f}B held={held} upstream_connections={upc}")
    p.terminate(); p.wait()
asyncio.run(main())
