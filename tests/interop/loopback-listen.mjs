// Preload (`node --import ./loopback-listen.mjs <server.js> ...`) that makes an unmodified
// Node.js server listen on 127.0.0.1 with an ephemeral port, whatever port and host it asks
// for, and prints `LISTENING <port>` on stdout once it does.
import net from 'node:net';

const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
    const cb = typeof args[args.length - 1] === 'function' ? args.pop() : undefined;
    this.once('listening', () => {
        process.stdout.write(`LISTENING ${this.address().port}\n`);
    });
    return cb ? listen.call(this, { port: 0, host: '127.0.0.1' }, cb) : listen.call(this, { port: 0, host: '127.0.0.1' });
};
