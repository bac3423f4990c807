#!/usr/bin/python3
"""An external moerl reward server in Python.

It takes the place of one built-in reward worker (`moerl reward --worker-id I`):
it binds a ZeroMQ ROUTER socket on the reward endpoint, answers every
score_request with a score_reply (or an error), and optionally registers with
the learner on its control socket (hello, heartbeats, the learner's stop) so
that it shows up in `moerl ctl status` and exits when the run ends.

The wire protocol is docs/protocol.md (protocol version 1): one MessagePack
map per ZeroMQ frame, "type" and "v" first. A ROUTER receives
[routing id][message] (or [routing id][empty][message] from a REQ client) and
answers on the same route.

Scoring: a simple verifier. The completion's first line, trimmed, is compared
with the reference answer, trimmed; a match earns --hit (default 1.0), anything
else --miss (default 0.0). Each reply carries the reward version
(--reward-version, default 1) and the detail "python_exact" (1 or 0) per
completion.

Needs only the Debian packages python3-zmq and python3-msgpack:

    /usr/bin/python3 reward/examples/python_reward_server.py \\
        --bind tcp://127.0.0.1:5574 --learner tcp://127.0.0.1:5570 --worker-id reward-0

Exit status: 0 after SIGTERM/SIGINT or the learner's stop; 1 when the socket
cannot be bound, or (with --learner) when the learner stopped answering for
--learner-timeout-ms; 2 on a usage error.
"""

import argparse
import math
import os
import signal
import socket
import struct
import sys
import time

try:
    import msgpack
    import zmq
except ImportError as e:  # a clear message rather than a traceback
    sys.stderr.write("python_reward_server: %s (install python3-zmq and python3-msgpack)\n" % e)
    sys.exit(1)

PROTOCOL_VERSION = 1
MAX_NAME = 256
MAX_TEXT = 1 << 24
MAX_MAP = 256
MAX_SAMPLES = 4096
MAX_TOKENS = 1 << 22
U64_MAX = (1 << 64) - 1
FINISH = ("stop", "length", "abort")
E_MALFORMED = -4
E_INVALID = -1
E_NOTFOUND = -8
E_STATE = -9


class Malformed(Exception):
    """A message that breaks a protocol rule; the text names the field."""


def log(name, text):
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
    sys.stderr.write("%s.%03dZ %s: %s\n" % (stamp, int(now * 1000) % 1000, name, text))
    sys.stderr.flush()


# ---- Decoding and validation ----

def _pairs(pairs):
    """object_pairs_hook: string keys only, none repeated."""
    out = {}
    for k, v in pairs:
        if not isinstance(k, str):
            raise Malformed("a map key is %s, expected a string" % type(k).__name__)
        if k in out:
            raise Malformed("key '%s' appears twice" % k)
        out[k] = v
    return out


def decode(frame):
    """The message map of one frame (MO_EMALFORMED rules of docs/protocol.md)."""
    try:
        m = msgpack.unpackb(frame, raw=False, object_pairs_hook=_pairs, strict_map_key=False)
    except Malformed:
        raise
    except Exception as e:  # invalid MessagePack, invalid UTF-8, trailing bytes
        raise Malformed("message: not one valid MessagePack object (%s)" % e)
    if not isinstance(m, dict):
        raise Malformed("message: expected a map, got %s" % type(m).__name__)
    t = m.get("type")
    if not isinstance(t, str):
        raise Malformed("message.type: missing or not a string")
    v = m.get("v")
    if not _is_int(v) or v != PROTOCOL_VERSION:
        raise Malformed("%s.v: protocol version %r, this server speaks %d" % (t, v, PROTOCOL_VERSION))
    return m


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _u64(where, x):
    if not _is_int(x) or x < 0 or x > U64_MAX:
        raise Malformed("%s: expected an unsigned integer, got %r" % (where, x))
    return x


def _str(where, x, lo, hi, required=True):
    if x is None:
        if required:
            raise Malformed("%s: missing" % where)
        return None
    if not isinstance(x, str):
        raise Malformed("%s: expected a string, got %s" % (where, type(x).__name__))
    n = len(x.encode("utf-8", "surrogatepass"))
    if n < lo or n > hi:
        raise Malformed("%s: %d bytes, expected %d .. %d" % (where, n, lo, hi))
    if "\0" in x:
        raise Malformed("%s: contains a NUL byte" % where)
    return x


def check_score_request(m):
    """The fields of a score_request, checked; raises Malformed naming the field."""
    gid = _u64("score_request.group_id", m.get("group_id"))
    _str("score_request.prompt_id", m.get("prompt_id"), 1, MAX_NAME)
    prompt = _str("score_request.prompt", m.get("prompt"), 0, MAX_TEXT, False)
    answer = _str("score_request.answer", m.get("answer"), 0, MAX_TEXT, False)
    extra = m.get("extra")
    if extra is not None:
        if not isinstance(extra, dict) or len(extra) > MAX_MAP:
            raise Malformed("score_request.extra: expected a map of at most %d strings" % MAX_MAP)
        for k, v in extra.items():
            _str("score_request.extra key", k, 1, MAX_NAME)
            _str("score_request.extra[%s]" % k, v, 0, MAX_TEXT)
    samples = m.get("samples")
    if not isinstance(samples, list):
        raise Malformed("score_request.samples: missing or not an array")
    if len(samples) < 1 or len(samples) > MAX_SAMPLES:
        raise Malformed("score_request.samples: %d samples, expected 1 .. %d"
                        % (len(samples), MAX_SAMPLES))
    out = []
    for i, s in enumerate(samples):
        where = "score_request.samples[%d]" % i
        if not isinstance(s, dict):
            raise Malformed("%s: expected a map" % where)
        text = _str(where + ".text", s.get("text"), 0, MAX_TEXT)
        n = s.get("n_tokens")
        if not _is_int(n) or n < 0 or n > MAX_TOKENS:
            raise Malformed("%s.n_tokens: expected an integer 0 .. %d, got %r" % (where, MAX_TOKENS, n))
        fin = s.get("finish_reason")
        if fin not in FINISH:
            raise Malformed("%s.finish_reason: %r, expected stop, length or abort" % (where, fin))
        out.append((text, n, fin))
    return gid, prompt, answer, extra or {}, out


# ---- Scoring ----

def first_line(text):
    return text.split("\n", 1)[0].strip()


def score(args, answer, samples):
    """(rewards, details) of the completions against the reference answer."""
    want = (answer or "").strip()
    rewards, details = [], []
    for text, _n, _fin in samples:
        ok = want != "" and first_line(text) == want
        rewards.append(args.hit if ok else args.miss)
        details.append({"python_exact": 1.0 if ok else 0.0})
    return rewards, details


# ---- Encoding ----

def pack(msg_type, fields):
    m = {"type": msg_type, "v": PROTOCOL_VERSION}
    m.update(fields)
    return msgpack.packb(m, use_bin_type=True)


def f32_vector(values):
    return {"dtype": "F32", "shape": [len(values)], "data": struct.pack("<%df" % len(values), *values)}


def score_reply(gid, version, rewards, details, score_ms):
    return pack("score_reply", {"group_id": gid, "reward_version": version,
                                "rewards": f32_vector(rewards), "details": details,
                                "score_ms": score_ms})


def error(code, message, about, gid=None):
    fields = {"code": code, "message": message[:1000] or "failed", "about": about}
    if gid is not None:
        fields["id"] = gid
    return pack("error", fields)


# ---- The server ----

class Server:
    def __init__(self, args):
        self.args = args
        self.name = args.worker_id
        self.ctx = zmq.Context()
        self.server = self.ctx.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 1000)
        self.server.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.server.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.server.setsockopt(zmq.MAXMSGSIZE, args.max_msg_bytes)
        self.server.bind(args.bind)
        self.control = None
        self.welcomed = False
        self.heartbeat_ms = args.heartbeat_ms
        self.last_hello = 0.0
        self.last_beat = 0.0
        self.last_answer = time.monotonic()
        self.stopping = False
        self.armed = False  # welcomed once: from then on the learner must keep answering
        self.groups = self.samples = self.malformed = 0
        self.reward_sum = 0.0
        if args.learner:
            self.control = self.ctx.socket(zmq.DEALER)
            self.control.setsockopt(zmq.LINGER, 1000)
            self.control.setsockopt(zmq.ROUTING_ID, self.name.encode())
            self.control.setsockopt(zmq.MAXMSGSIZE, args.max_msg_bytes)
            self.control.connect(args.learner)

    # -- reward socket --

    def on_request(self):
        frames = self.server.recv_multipart()
        route = frames[:1]
        if len(frames) == 3 and frames[1] == b"":
            route = frames[:2]  # a REQ client: answer with the delimiter too
        elif len(frames) != 2:
            self.malformed += 1
            log(self.name, "dropped a request of %d frames" % len(frames))
            return
        gid = None
        try:
            m = decode(frames[-1])
            if m["type"] != "score_request":
                raise Malformed("%s on the reward socket: expected score_request" % m["type"])
            if _is_int(m.get("group_id")) and 0 <= m["group_id"] <= U64_MAX:
                gid = m["group_id"]
            gid, _prompt, answer, _extra, samples = check_score_request(m)
        except Malformed as e:
            self.malformed += 1
            log(self.name, "malformed request: %s" % e)
            self.send(route, error(E_MALFORMED, str(e), "score_request", gid))
            return
        if self.stopping:
            self.send(route, error(E_STATE, "this reward worker is stopping", "score_request", gid))
            return
        t0 = time.monotonic()
        rewards, details = score(self.args, answer, samples)
        if not all(math.isfinite(r) for r in rewards):
            self.send(route, error(E_INVALID, "non-finite reward", "score_request", gid))
            return
        ms = (time.monotonic() - t0) * 1e3
        self.send(route, score_reply(gid, self.args.reward_version, rewards, details, ms))
        self.groups += 1
        self.samples += len(rewards)
        self.reward_sum += sum(rewards)

    def send(self, route, payload):
        try:
            self.server.send_multipart(route + [payload], zmq.DONTWAIT)
        except zmq.ZMQError as e:  # the rollout went away, or its queue is full
            log(self.name, "reply not sent: %s" % e)

    # -- control socket (optional registration with the learner) --

    def send_control(self, payload):
        try:
            self.control.send(payload, zmq.DONTWAIT)
        except zmq.ZMQError as e:
            log(self.name, "send to the learner: %s" % e)

    def hello(self):
        self.send_control(pack("hello", {"role": "reward", "worker_id": self.name,
                                         "pid": os.getpid(), "host": socket.gethostname()[:256],
                                         "software": "moerl python_reward_server"}))
        self.last_hello = time.monotonic()

    def heartbeat(self):
        self.send_control(pack("heartbeat", {"worker_id": self.name, "role": "reward",
                                             "reward_version": self.args.reward_version,
                                             "inflight": 0, "tokens_per_s": 0.0,
                                             "queue_depth": 0}))
        self.last_beat = time.monotonic()

    def on_control(self):
        try:
            m = decode(self.control.recv())
        except Malformed as e:
            self.malformed += 1
            log(self.name, "malformed message from the learner: %s" % e)
            return
        self.last_answer = time.monotonic()
        t = m["type"]
        if t == "welcome":
            hb = m.get("heartbeat_ms")
            if _is_int(hb) and 10 <= hb <= 600000:
                self.heartbeat_ms = hb
            if not self.welcomed:
                log(self.name, "registered with the learner (job %s)" % m.get("job"))
            self.welcomed = self.armed = True
            self.heartbeat()
        elif t == "heartbeat":
            pass  # the learner's answer to ours: it is alive
        elif t == "ctl_request" and m.get("command") == "stop":
            log(self.name, "the learner asked to stop")
            self.stopping = True
        elif t == "reward_swap":
            # This server has one fixed verifier: refuse, as a built-in worker refuses a
            # function it cannot build; the learner reports the error in `moerl ctl status`.
            self.send_control(error(E_INVALID, "python_reward_server cannot load reward functions",
                                    "reward_swap", m.get("version") if _is_int(m.get("version")) else None))
        elif t == "error" and m.get("code") == E_NOTFOUND and m.get("about") == "heartbeat":
            log(self.name, "the learner does not know this worker: registering again")
            self.welcomed = False
            self.hello()

    def tick(self):
        now = time.monotonic()
        if not self.welcomed:
            if now - self.last_hello >= 2.0:
                self.hello()
        elif now - self.last_beat >= self.heartbeat_ms / 1e3:
            self.heartbeat()
        timeout = self.args.learner_timeout_ms
        if timeout is None:
            timeout = 10 * self.heartbeat_ms
        if self.armed and timeout > 0 and (now - self.last_answer) * 1e3 > timeout:
            raise SystemExit(self.fail("no answer from the learner at %s for %d ms: exiting"
                                       % (self.args.learner, timeout)))

    def fail(self, text):
        log(self.name, text)
        return 1

    def run(self):
        poller = zmq.Poller()
        poller.register(self.server, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control, zmq.POLLIN)
            self.hello()
        log(self.name, "ready: serving %s, pid %d" % (self.args.bind, os.getpid()))
        while not self.stopping:
            try:
                events = dict(poller.poll(50))
            except zmq.ZMQError as e:
                if e.errno == zmq.EINTR or self.stopping:
                    continue
                raise
            if self.server in events:
                self.on_request()
            if self.control is not None and self.control in events:
                self.on_control()
            if self.control is not None:
                self.tick()
        log(self.name, "exiting: %d groups, %d samples scored, mean reward %.6g, %d malformed"
            % (self.groups, self.samples, self.reward_sum / max(self.samples, 1), self.malformed))
        return 0

    def close(self):
        self.server.close()
        if self.control is not None:
            self.control.close()
        self.ctx.term()


def main(argv):
    p = argparse.ArgumentParser(description="An external moerl reward server (docs/rewards.md).")
    p.add_argument("--bind", required=True, help="the reward endpoint to bind (ROUTER)")
    p.add_argument("--learner", default="", help="the learner's control endpoint (optional)")
    p.add_argument("--worker-id", default="reward-0", help="wire id when registering")
    p.add_argument("--hit", type=float, default=1.0, help="reward of a right completion")
    p.add_argument("--miss", type=float, default=0.0, help="reward of a wrong completion")
    p.add_argument("--reward-version", type=int, default=1, help="version stamped on replies")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="until the welcome says")
    p.add_argument("--learner-timeout-ms", type=int, default=None,
                   help="exit (status 1) when the learner, once registered, sends nothing this "
                        "long (default: 10 heartbeat intervals; 0 = never)")
    p.add_argument("--max-msg-bytes", type=int, default=256 << 20, help="ZMQ_MAXMSGSIZE")
    args = p.parse_args(argv)
    for name in ("hit", "miss"):
        if not math.isfinite(getattr(args, name)):
            p.error("--%s must be finite" % name)
    if args.reward_version < 1 or args.reward_version > U64_MAX:
        p.error("--reward-version must be at least 1")
    try:
        _str("--worker-id", args.worker_id, 1, 64)
    except Malformed as e:
        p.error(str(e))
    try:
        srv = Server(args)
    except zmq.ZMQError as e:
        sys.stderr.write("python_reward_server: bind %s: %s\n" % (args.bind, e))
        return 1

    def on_signal(signum, _frame):
        if srv.stopping:
            os._exit(1)
        log(srv.name, "signal %d: stopping" % signum)
        srv.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return srv.run()
    except SystemExit as e:
        return e.code
    finally:
        srv.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
