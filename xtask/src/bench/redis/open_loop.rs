//! An open-loop redis client: SETs and GETs sent at times drawn in advance
//! (a Poisson process at a fixed mean rate), whatever the replies do, each
//! request's latency counted from when it was due to be sent.
//!
//! redis-benchmark's clients each wait for a reply before they send again:
//! a slower server is sent less, so its p99 is mostly queueing among the
//! fifty clients and says little of what a user waits. Here the requests
//! keep coming while a window (a stretch of trapped calls) slows the
//! server, so the requests it catches show the delay in full, and a
//! client that falls behind is counted late rather than hidden.
use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::window_trace::monotonic_ns;

/// What the client sends.
#[derive(Clone, Copy)]
pub(super) struct Schedule {
    /// Requests per second, on average.
    pub rate: f64,
    /// How long it sends.
    pub length: Duration,
    /// Connections the requests are dealt over in turn.
    pub connections: usize,
    /// Bytes of each SET's value.
    pub value_bytes: usize,
    /// Seeds the send times and keys: the same seed, the same requests.
    pub seed: u64,
}

/// Each request, in the order they were due: when (microseconds from the
/// start) and how long it waited (microseconds).
#[derive(Default)]
pub(super) struct Served {
    /// The start, on the kernel's monotonic clock in nanoseconds.
    start_ns: u64,
    requests: Vec<(u32, u32)>,
}

impl Served {
    /// The latencies of the requests due at times (monotonic
    /// nanoseconds) that `keep` keeps.
    pub fn latencies(&self, keep: impl Fn(u64) -> bool) -> Latencies {
        Latencies::of(self.kept(keep).collect())
    }

    /// The latencies, unsorted, of the requests due at times that `keep`
    /// keeps: for pooling several runs' before sorting once.
    pub fn kept<'a>(&'a self, keep: impl Fn(u64) -> bool + 'a) -> impl Iterator<Item = u32> + 'a {
        self.due_at(keep).map(|&(_, late)| late)
    }

    /// The requests (due, latency) due at times that `keep` keeps.
    fn due_at<'a>(
        &'a self,
        keep: impl Fn(u64) -> bool + 'a,
    ) -> impl Iterator<Item = &'a (u32, u32)> + 'a {
        self.requests
            .iter()
            .filter(move |(due, _)| keep(self.start_ns + u64::from(*due) * 1000))
    }

    /// The requests due at times that `keep` keeps, and the stalls among
    /// them: runs of requests that waited over [`STALL_US`], a run ending
    /// where the next such request was due over [`STALL_GAP_US`] later.
    /// A stall makes many requests wait, so a p99 over a few thousand
    /// requests can hang on one or two: their count says how often.
    pub fn stalls(&self, keep: impl Fn(u64) -> bool) -> Stalls {
        let mut stalls = Stalls::default();
        let mut last_slow: Option<u32> = None;
        for &(due, late) in self.due_at(keep) {
            stalls.requests += 1;
            if late <= STALL_US {
                continue;
            }
            if last_slow.is_none_or(|at| due - at > STALL_GAP_US) {
                stalls.count += 1;
            }
            last_slow = Some(due);
        }
        stalls
    }
}

/// A request that waited longer than this (µs) was held up by something
/// beside the traps: the server's p99 is a third of it.
const STALL_US: u32 = 1000;

/// Slow requests due within this (µs) of each other are one stall's.
const STALL_GAP_US: u32 = 3000;

/// Requests, and the stalls among them ([`Served::stalls`]).
#[derive(Default, Clone, Copy)]
pub(super) struct Stalls {
    pub requests: usize,
    pub count: usize,
}

impl std::ops::AddAssign for Stalls {
    fn add_assign(&mut self, other: Self) {
        self.requests += other.requests;
        self.count += other.count;
    }
}

impl std::fmt::Display for Stalls {
    /// Stalls per 10,000 requests, and how many in all.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = 1e4 * self.count as f64 / self.requests.max(1) as f64;
        write!(f, "{per:.1} ({})", self.count)
    }
}

/// Latencies in microseconds, sorted.
pub(super) struct Latencies(Vec<u32>);

impl Latencies {
    /// `latencies` in microseconds, in any order.
    pub fn of(mut latencies: Vec<u32>) -> Latencies {
        latencies.sort_unstable();
        Latencies(latencies)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The latency `fraction` of the requests were within (0.99: p99), in
    /// milliseconds.
    pub fn quantile_ms(&self, fraction: f64) -> f64 {
        let Some(last) = self.0.len().checked_sub(1) else {
            return 0.0;
        };
        let at = ((last as f64) * fraction).round() as usize;
        f64::from(self.0[at.min(last)]) / 1000.0
    }
}

/// The keys redis-benchmark's `-r 1000000` fills: `key:` and twelve digits.
const KEYS: u64 = 1_000_000;

/// Sends `schedule`'s requests to the redis-server at `port` on loopback
/// and waits for every reply.
pub(super) fn fixed_rate(port: &str, schedule: Schedule) -> Result<Served> {
    let due = Arc::new(send_times(&schedule));
    let mut writers = Vec::new();
    for _ in 0..schedule.connections {
        let stream = TcpStream::connect(format!("127.0.0.1:{port}"))
            .with_context(|| format!("connecting to redis-server on port {port}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        writers.push(stream);
    }
    // Time for the readers to be waiting before the first request is due.
    let start = Instant::now() + Duration::from_millis(50);
    let start_ns = monotonic_ns() + 50_000_000;
    let mut readers = Vec::new();
    for (connection, stream) in writers.iter().enumerate() {
        let (reader, due) = (stream.try_clone()?, due.clone());
        let count = schedule.connections;
        readers.push(std::thread::spawn(move || {
            super::pin_to_client_cpu();
            read_replies(reader, &due, connection, count)
        }));
    }
    // On a thread of its own: its CPU and timer slack must not pass to the
    // caller, and from it to the processes the caller starts (memprobe).
    let sent = std::thread::scope(|scope| {
        scope
            .spawn(|| send(&mut writers, &due, start, Requests::new(schedule)))
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the request sender panicked")))
    });
    let micros = |d: Duration| u32::try_from(d.as_micros()).unwrap_or(u32::MAX);
    let mut requests = Vec::with_capacity(due.len());
    for reader in readers {
        let arrivals = reader
            .join()
            .map_err(|_| anyhow::anyhow!("a reply reader panicked"))??;
        for (index, arrived) in arrivals {
            let late = arrived.saturating_duration_since(start + due[index]);
            requests.push((micros(due[index]), micros(late)));
        }
    }
    sent?;
    requests.sort_unstable();
    Ok(Served { start_ns, requests })
}

/// When each request is due, from the start: gaps drawn from an
/// exponential distribution of mean 1/rate, so that arrivals bunch as
/// independent users' do.
fn send_times(schedule: &Schedule) -> Vec<Duration> {
    let mut random = SplitMix(schedule.seed);
    let mut at = 0.0f64;
    let mut times = Vec::new();
    let end = schedule.length.as_secs_f64();
    loop {
        // 1 - u is in (0, 1]: its logarithm is finite.
        at += -(1.0 - random.unit()).ln() / schedule.rate;
        if at >= end {
            return times;
        }
        times.push(Duration::from_secs_f64(at));
    }
}

/// Writes each request when it is due, to the connections in turn.
fn send(
    writers: &mut [TcpStream],
    due: &[Duration],
    start: Instant,
    mut requests: Requests,
) -> Result<()> {
    super::pin_to_client_cpu();
    // Wake when asked, not up to 50 µs later: the send times are the
    // schedule's, not the timer's.
    // SAFETY: prctl with an integer argument changes this thread alone.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64) };
    let mut request = Vec::new();
    for (index, at) in due.iter().enumerate() {
        if let Some(wait) = (start + *at).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        requests.next(index, &mut request);
        writers[index % writers.len()]
            .write_all(&request)
            .context("sending to redis-server")?;
    }
    Ok(())
}

/// Reads one connection's replies (requests `first`, `first + step`, ...)
/// and says when each came in.
fn read_replies(
    mut stream: TcpStream,
    due: &[Duration],
    first: usize,
    step: usize,
) -> Result<Vec<(usize, Instant)>> {
    let expected = due.len().saturating_sub(first).div_ceil(step);
    let mut arrivals = Vec::with_capacity(expected);
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    while arrivals.len() < expected {
        let read = stream
            .read(&mut chunk)
            .context("waiting for redis-server's replies")?;
        if read == 0 {
            bail!("redis-server closed the connection");
        }
        let arrived = Instant::now();
        buffer.extend_from_slice(&chunk[..read]);
        let mut parsed = 0;
        while let Some(length) = reply_length(&buffer[parsed..]) {
            parsed += length;
            arrivals.push((first + arrivals.len() * step, arrived));
        }
        buffer.drain(..parsed);
    }
    Ok(arrivals)
}

/// The length of the complete reply `bytes` start with, if it is all
/// there: a line (`+OK`, `-ERR ...`, `:1`) or a bulk string (`$3`, its
/// bytes; `$-1` for a key not set).
fn reply_length(bytes: &[u8]) -> Option<usize> {
    let line_end = bytes.windows(2).position(|pair| pair == b"\r\n")? + 2;
    match bytes.first()? {
        b'$' => {
            let length: i64 = std::str::from_utf8(&bytes[1..line_end - 2])
                .ok()?
                .parse()
                .ok()?;
            if length < 0 {
                return Some(line_end);
            }
            let end = line_end + length as usize + 2;
            (bytes.len() >= end).then_some(end)
        }
        _ => Some(line_end),
    }
}

/// The requests in order: SET and GET in turn, of random keys among those
/// the server was filled with.
struct Requests {
    random: SplitMix,
    value: Vec<u8>,
}

impl Requests {
    fn new(schedule: Schedule) -> Self {
        Self {
            // Another stream than the send times'.
            random: SplitMix(schedule.seed ^ 0x6b65_7973),
            value: vec![b'x'; schedule.value_bytes],
        }
    }

    /// Request `index`, encoded as RESP into `out`.
    fn next(&mut self, index: usize, out: &mut Vec<u8>) {
        let key = format!("key:{:012}", self.random.next() % KEYS);
        out.clear();
        if index.is_multiple_of(2) {
            out.extend_from_slice(b"*3\r\n$3\r\nSET\r\n");
            bulk(out, key.as_bytes());
            bulk(out, &self.value);
        } else {
            out.extend_from_slice(b"*2\r\n$3\r\nGET\r\n");
            bulk(out, key.as_bytes());
        }
    }
}

/// A RESP bulk string.
fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(format!("${}\r\n", bytes.len()).as_bytes());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// SplitMix64: a few lines of well-mixed random numbers, seeded.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_cut_where_they_end() {
        assert_eq!(reply_length(b"+OK\r\n$3\r\nxxx\r\n"), Some(5));
        assert_eq!(reply_length(b"$3\r\nxxx\r\n+OK"), Some(9));
        assert_eq!(reply_length(b"$-1\r\n"), Some(5));
        // Not all there yet.
        assert_eq!(reply_length(b"$3\r\nxx"), None);
        assert_eq!(reply_length(b"+O"), None);
    }

    #[test]
    fn send_times_keep_the_rate_and_the_seed_repeats_them() {
        let schedule = Schedule {
            rate: 10_000.0,
            length: Duration::from_secs(2),
            connections: 1,
            value_bytes: 3,
            seed: 7,
        };
        let times = send_times(&schedule);
        // 20,000 expected; a Poisson count's deviation is 141.
        assert!((19_500..20_500).contains(&times.len()), "{}", times.len());
        assert!(times.windows(2).all(|pair| pair[0] <= pair[1]));
        assert_eq!(times, send_times(&schedule));
    }

    #[test]
    fn requests_are_set_and_get_in_turn() {
        let schedule = Schedule {
            rate: 1.0,
            length: Duration::from_secs(1),
            connections: 1,
            value_bytes: 3,
            seed: 1,
        };
        let mut requests = Requests::new(schedule);
        let mut out = Vec::new();
        requests.next(0, &mut out);
        let set = String::from_utf8(out.clone()).unwrap();
        assert!(set.starts_with("*3\r\n$3\r\nSET\r\n$16\r\nkey:"), "{set}");
        assert!(set.ends_with("\r\n$3\r\nxxx\r\n"), "{set}");
        requests.next(1, &mut out);
        let get = String::from_utf8(out).unwrap();
        assert!(get.starts_with("*2\r\n$3\r\nGET\r\n$16\r\nkey:"), "{get}");
    }

    #[test]
    fn quantiles_read_the_sorted_latencies() {
        let latencies = Latencies((1..=1000).collect());
        assert_eq!(latencies.quantile_ms(0.5), 0.501);
        assert_eq!(latencies.quantile_ms(0.99), 0.990);
        assert_eq!(latencies.quantile_ms(1.0), 1.0);
        assert_eq!(Latencies(Vec::new()).quantile_ms(0.99), 0.0);
    }

    #[test]
    fn requests_are_kept_by_when_they_were_due() {
        let served = Served {
            start_ns: 1_000_000_000,
            requests: vec![(0, 30), (1_000, 900), (2_000, 40), (3_000, 50)],
        };
        // Due from 1.0005 s to 1.0025 s: the second and third.
        let during = |ns: u64| (1_000_500_000..1_002_500_000).contains(&ns);
        assert_eq!(served.latencies(during).0, vec![40, 900]);
        assert_eq!(served.latencies(|ns| !during(ns)).0, vec![30, 50]);
        let all = Latencies::of(
            served
                .kept(during)
                .chain(served.kept(|ns| !during(ns)))
                .collect(),
        );
        assert_eq!(all.0, vec![30, 40, 50, 900]);
        assert_eq!(all.len(), 4);
    }

    #[test]
    fn slow_requests_due_close_together_are_one_stall() {
        let served = Served {
            start_ns: 0,
            // Two slow requests 2 ms apart (one stall), one 10 ms later
            // (another), and one as slow as the threshold (none).
            requests: vec![
                (0, 100),
                (1_000, 1_500),
                (3_000, 2_500),
                (4_000, 1_000),
                (13_000, 4_000),
                (20_000, 90),
            ],
        };
        let stalls = served.stalls(|_| true);
        assert_eq!((stalls.requests, stalls.count), (6, 2));
        assert_eq!(stalls.to_string(), "3333.3 (2)");
        // Those due from 10 ms on: the later stall alone.
        let late = served.stalls(|ns| ns >= 10_000_000);
        assert_eq!((late.requests, late.count), (2, 1));
    }
}
