//! The `rig-helper` subcommands: an echo server and a socket client. They live in the library
//! so that any binary (rig-helper, demo) can act as the helper.
//!
//! Both first enter the requested network namespace with `setns`, before any thread exists,
//! so that every thread and socket belongs to it. Only the network namespace is entered: the
//! host mount namespace (cgroup2, bpffs) stays visible.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::{
    Result, RigError,
    cgroup::join_cgroup,
    client::{Mode, Proto},
    netns::enter_netns,
};

#[derive(Debug, Parser)]
#[command(about = "kubeproxy-rs test rig helper: echo server, socket client, benchmark loops")]
pub struct Cli {
    #[command(subcommand)]
    pub command: HelperCommand,
}

#[derive(Debug, Subcommand)]
pub enum HelperCommand {
    /// Serve TCP and UDP on one address, answering `NAME CLIENTIP:CLIENTPORT`.
    Echo {
        #[arg(long)]
        name: String,
        #[arg(long)]
        listen: SocketAddr,
        /// TCP: answer `NAME ORIGINAL-DESTINATION` (SO_ORIGINAL_DST) instead of the client:
        /// what a service-mesh sidecar behind an iptables REDIRECT sees.
        #[arg(long)]
        original_dst: bool,
        /// Network namespace file to enter first, e.g. /run/netns/NAME.
        #[arg(long)]
        netns: Option<PathBuf>,
    },
    /// Make N independent connection attempts and print one result line per attempt.
    Client(ClientArgs),
    /// Benchmark loop in one process: new connections (connect, read the greeting, close) or
    /// request/response round trips on one connection; prints one latency sample (ns) a line
    /// after a `summary` line. See `bench::client`.
    BenchConnect(crate::bench::client::BenchConnectArgs),
    /// Connects in a tight loop until an answer comes from one of the expected backends; prints
    /// when (CLOCK_MONOTONIC) that connection started. See `bench::client`.
    BenchProbe(crate::bench::client::BenchProbeArgs),
    /// Connects every millisecond until stdin closes; prints the longest time without a
    /// correct answer and the wrong answers. See `bench::client`.
    BenchGaps(crate::bench::client::BenchGapsArgs),
    /// Connects one UDP socket to a target again and again, counting refusals. See
    /// `connect_loop`.
    ConnectLoop(crate::connect_loop::ConnectLoopArgs),
    /// Open-loop load of short TCP connections at a fixed rate (the SNAT benchmark); prints one
    /// summary line. See `bench::snat`.
    SnatLoad(crate::bench::snat::SnatLoadArgs),
}

/// `rig-helper client`: see [`HelperCommand::Client`].
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 1)]
    count: u32,
    #[arg(long, value_enum, default_value_t = Proto::Tcp)]
    proto: Proto,
    #[arg(long)]
    netns: Option<PathBuf>,
    /// cgroup2 directory to join (by writing our pid to its cgroup.procs).
    #[arg(long)]
    cgroup: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    #[arg(long, value_enum, default_value_t = Mode::Connect)]
    mode: Mode,
    /// Pause between attempts.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Source address to bind before connecting (`connect` mode only): a client with
    /// several addresses, e.g. one outside a Service's `loadBalancerSourceRanges`.
    #[arg(long)]
    bind: Option<std::net::IpAddr>,
    /// Stops before the next attempt once this file exists (`--count` stays the bound): a
    /// run as long as what it watches, without a guess at its length.
    #[arg(long)]
    until: Option<PathBuf>,
}

/// Runs a parsed helper command (never returns for `echo` unless binding fails).
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        HelperCommand::Echo {
            name,
            listen,
            original_dst,
            netns,
        } => {
            // Die with the rig: an orphaned server would keep its namespace alive.
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(|e| RigError::nix("prctl(PR_SET_PDEATHSIG)", e))?;
            if let Some(ns) = netns {
                enter_netns(&ns)?;
            }
            echo(&name, listen, original_dst)
        }
        HelperCommand::Client(args) => {
            if let Some(ns) = &args.netns {
                enter_netns(ns)?;
            }
            if let Some(cg) = &args.cgroup {
                join_cgroup(cg)?;
            }
            if args.bind.is_some() && args.mode != Mode::Connect {
                return Err(RigError::Other(
                    "--bind only applies to --mode connect".into(),
                ));
            }
            client(&args)
        }
        HelperCommand::BenchConnect(args) => {
            enter_places(args.netns.as_deref(), args.cgroup.as_deref())?;
            crate::bench::client::bench_connect(&args)
        }
        HelperCommand::BenchProbe(args) => {
            enter_places(args.netns.as_deref(), args.cgroup.as_deref())?;
            crate::bench::client::bench_probe(&args)
        }
        HelperCommand::BenchGaps(args) => {
            enter_places(args.netns.as_deref(), args.cgroup.as_deref())?;
            crate::bench::client::bench_gaps(&args)
        }
        HelperCommand::ConnectLoop(args) => {
            enter_places(args.netns.as_deref(), args.cgroup.as_deref())?;
            crate::connect_loop::connect_loop(&args)
        }
        HelperCommand::SnatLoad(args) => {
            enter_places(args.netns.as_deref(), None)?;
            crate::bench::snat::snat_load(&args)
        }
    }
}

/// Enters the network namespace, then the cgroup (both optional), before any thread exists.
fn enter_places(netns: Option<&Path>, cgroup: Option<&Path>) -> Result<()> {
    if let Some(ns) = netns {
        enter_netns(ns)?;
    }
    if let Some(cg) = cgroup {
        join_cgroup(cg)?;
    }
    Ok(())
}

fn echo(name: &str, listen: SocketAddr, original_dst: bool) -> Result<()> {
    let tcp =
        TcpListener::bind(listen).map_err(|e| RigError::io(format!("binding TCP {listen}"), e))?;
    let udp =
        UdpSocket::bind(listen).map_err(|e| RigError::io(format!("binding UDP {listen}"), e))?;
    let mut out = io::stdout();
    writeln!(out, "ready")
        .and_then(|()| out.flush())
        .map_err(|e| RigError::io("printing ready", e))?;

    let udp_name = name.to_owned();
    thread::spawn(move || serve_udp(&udp_name, &udp));
    for conn in tcp.incoming() {
        // A failed accept (e.g. the peer reset early) only affects that connection.
        let Ok(conn) = conn else { continue };
        let name = name.to_owned();
        thread::spawn(move || {
            let _ = serve_tcp(&name, conn, original_dst);
        });
    }
    Ok(())
}

fn serve_tcp(name: &str, conn: TcpStream, original_dst: bool) -> io::Result<()> {
    // Each reply is one small write: without this, Nagle could hold a reply back until the
    // previous one is acknowledged, which would distort request/response timings.
    conn.set_nodelay(true)?;
    let peer = if original_dst {
        original_destination(&conn)?
    } else {
        conn.peer_addr()?
    };
    let mut writer = conn.try_clone()?;
    writer.write_all(format!("{name} {peer}\n").as_bytes())?;
    for line in BufReader::new(conn).lines() {
        writer.write_all(format!("{}\n", line?).as_bytes())?;
    }
    Ok(())
}

/// Where the client meant to connect before netfilter NAT redirected it here (`SO_ORIGINAL_DST`
/// / `IP6T_SO_ORIGINAL_DST`, both 80): how Istio's and Linkerd's proxies learn the Service
/// address of a captured connection.
fn original_destination(conn: &TcpStream) -> io::Result<SocketAddr> {
    use std::os::fd::AsRawFd as _;
    const SO_ORIGINAL_DST: libc::c_int = 80;
    let local = conn.local_addr()?;
    // SAFETY: sockaddr_in6 is plain data; all zeroes is a valid value.
    let mut storage: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
    let level = if local.is_ipv6() {
        libc::SOL_IPV6
    } else {
        libc::SOL_IP
    };
    // SAFETY: a valid socket and an out-buffer of the size passed (large enough for both
    // families).
    let ret = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            level,
            SO_ORIGINAL_DST,
            (&raw mut storage).cast(),
            &raw mut len,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    if local.is_ipv6() {
        let ip = std::net::Ipv6Addr::from(storage.sin6_addr.s6_addr);
        Ok(SocketAddr::new(ip.into(), u16::from_be(storage.sin6_port)))
    } else {
        // SAFETY: for SOL_IP the kernel wrote a sockaddr_in, which fits in the buffer.
        let v4: libc::sockaddr_in = unsafe { std::ptr::read((&raw const storage).cast()) };
        let ip = std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
        Ok(SocketAddr::new(ip.into(), u16::from_be(v4.sin_port)))
    }
}

fn serve_udp(name: &str, sock: &UdpSocket) {
    let mut buf = [0u8; 2048];
    loop {
        if let Ok((_, peer)) = sock.recv_from(&mut buf) {
            let _ = sock.send_to(format!("{name} {peer}\n").as_bytes(), peer);
        }
    }
}

fn client(args: &ClientArgs) -> Result<()> {
    let (target, count, proto, mode, bind) =
        (args.target, args.count, args.proto, args.mode, args.bind);
    let timeout = Duration::from_millis(args.timeout_ms);
    let interval = Duration::from_millis(args.interval_ms);
    let until = args.until.as_deref();
    let mut out = io::stdout().lock();
    let start = std::time::Instant::now();
    let mut stream: Option<UdpSocket> = None;
    let mut unconnected: Option<UdpSocket> = None;
    let mut tcp_stream = TcpStreamState::default();
    for i in 0..count {
        if i > 0 && !interval.is_zero() {
            thread::sleep(interval);
        }
        if i > 0 && until.is_some_and(std::path::Path::exists) {
            break;
        }
        let started_ms = start.elapsed().as_millis();
        let result = match mode {
            Mode::Connect => attempt(target, proto, timeout, bind),
            Mode::Sendto => sendto_attempt(target, timeout),
            Mode::SendtoSocket => sendto_socket_attempt(&mut unconnected, target, timeout),
            Mode::Stream => stream_attempt(&mut stream, target, timeout),
            Mode::TcpStream => tcp_stream.attempt(target, timeout),
        };
        let line = match result {
            Ok((reply, peer)) => format!("ok {reply} peer={peer}"),
            Err(e) => format!("err {}", error_name(&e)),
        };
        writeln!(out, "{line} at={started_ms}")
            .and_then(|()| out.flush())
            .map_err(|e| RigError::io("printing attempt", e))?;
    }
    Ok(())
}

fn unspecified(target: SocketAddr) -> SocketAddr {
    if target.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        ([0u16; 8], 0).into()
    }
}

/// Unconnected UDP: the sendmsg hook translates, the recvmsg hook must show the reply as
/// coming from `target`.
fn sendto_attempt(target: SocketAddr, timeout: Duration) -> io::Result<(String, SocketAddr)> {
    let sock = UdpSocket::bind(unspecified(target))?;
    sock.set_read_timeout(Some(timeout))?;
    sock.send_to(b"x", target)?;
    let mut buf = [0u8; 2048];
    let (n, from) = sock.recv_from(&mut buf)?;
    let reply = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
    Ok((reply.trim_end().to_owned(), from))
}

/// One datagram from the long-lived unconnected socket; an error drops it.
fn sendto_socket_attempt(
    socket: &mut Option<UdpSocket>,
    target: SocketAddr,
    timeout: Duration,
) -> io::Result<(String, SocketAddr)> {
    let sock = match socket.take() {
        Some(sock) => sock,
        None => {
            let sock = UdpSocket::bind(unspecified(target))?;
            sock.set_read_timeout(Some(timeout))?;
            sock
        }
    };
    let result = (|| {
        sock.send_to(b"x", target)?;
        let mut buf = [0u8; 2048];
        let (n, from) = sock.recv_from(&mut buf)?;
        let reply = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
        Ok((reply.trim_end().to_owned(), from))
    })();
    if result.is_ok() {
        *socket = Some(sock);
    }
    result
}

/// One request on the long-lived connected socket; an error drops it, so the next attempt
/// connects anew (what a resolver's retry does).
fn stream_attempt(
    stream: &mut Option<UdpSocket>,
    target: SocketAddr,
    timeout: Duration,
) -> io::Result<(String, SocketAddr)> {
    let sock = match stream.take() {
        Some(sock) => sock,
        None => {
            let sock = UdpSocket::bind(unspecified(target))?;
            sock.connect(target)?;
            sock.set_read_timeout(Some(timeout))?;
            sock
        }
    };
    let result = (|| {
        sock.send(b"x")?;
        let mut buf = [0u8; 2048];
        let n = sock.recv(&mut buf)?;
        let reply = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
        Ok((reply.trim_end().to_owned(), sock.peer_addr()?))
    })();
    if result.is_ok() {
        *stream = Some(sock);
    }
    result
}

/// The long-lived connection of [`Mode::TcpStream`].
#[derive(Default)]
struct TcpStreamState {
    /// The connection, its reader and the backend's greeting line.
    open: Option<(TcpStream, BufReader<TcpStream>, String)>,
    connections: u32,
}

impl TcpStreamState {
    /// One line out and its echo back on the connection (made first if there is none); an
    /// error drops the connection, so the next attempt makes a new one.
    fn attempt(
        &mut self,
        target: SocketAddr,
        timeout: Duration,
    ) -> io::Result<(String, SocketAddr)> {
        let (conn, mut reader, greeting) = match self.open.take() {
            Some(open) => open,
            None => {
                let conn = TcpStream::connect_timeout(&target, timeout)?;
                conn.set_read_timeout(Some(timeout))?;
                conn.set_nodelay(true)?;
                let mut reader = BufReader::new(conn.try_clone()?);
                let mut greeting = String::new();
                if reader.read_line(&mut greeting)? == 0 {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF"));
                }
                self.connections += 1;
                (conn, reader, greeting.trim_end().to_owned())
            }
        };
        let request = format!("ping {}", self.connections);
        (&conn).write_all(format!("{request}\n").as_bytes())?;
        let mut echo = String::new();
        if reader.read_line(&mut echo)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF"));
        }
        if echo.trim_end() != request {
            return Err(io::Error::other(format!("echo {echo:?} for {request:?}")));
        }
        let peer = conn.peer_addr()?;
        let reply = match greeting.split_once(' ') {
            Some((name, client)) => format!("{name}#{} {client}", self.connections),
            None => greeting.clone(),
        };
        self.open = Some((conn, reader, greeting));
        Ok((reply, peer))
    }
}

/// A TCP connection to `target`, from `bind` (port chosen by the kernel) if given.
fn tcp_connect(
    target: SocketAddr,
    timeout: Duration,
    bind: Option<std::net::IpAddr>,
) -> io::Result<TcpStream> {
    let Some(source) = bind else {
        return TcpStream::connect_timeout(&target, timeout);
    };
    // std cannot bind a TcpStream before connecting; socket2 can.
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(target),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.bind(&SocketAddr::new(source, 0).into())?;
    sock.connect_timeout(&target.into(), timeout)?;
    Ok(sock.into())
}

/// One attempt on a fresh socket: returns the first reply line and getpeername().
fn attempt(
    target: SocketAddr,
    proto: Proto,
    timeout: Duration,
    bind: Option<std::net::IpAddr>,
) -> io::Result<(String, SocketAddr)> {
    match proto {
        Proto::Tcp => {
            let conn = tcp_connect(target, timeout, bind)?;
            conn.set_read_timeout(Some(timeout))?;
            let peer = conn.peer_addr()?;
            let mut line = String::new();
            if BufReader::new(&conn).read_line(&mut line)? == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF"));
            }
            Ok((line.trim_end().to_owned(), peer))
        }
        Proto::Udp => {
            let local = bind.map_or_else(|| unspecified(target), |ip| SocketAddr::new(ip, 0));
            let sock = UdpSocket::bind(local)?;
            sock.connect(target)?;
            sock.set_read_timeout(Some(timeout))?;
            let peer = sock.peer_addr()?;
            sock.send(b"x")?;
            let mut buf = [0u8; 2048];
            let n = sock.recv(&mut buf)?;
            let reply = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
            Ok((reply.trim_end().to_owned(), peer))
        }
    }
}

/// `TIMEOUT`, `EOF`, or the errno name (`ECONNREFUSED`, `ENETUNREACH`, ...).
fn error_name(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "TIMEOUT".into(),
        io::ErrorKind::UnexpectedEof => "EOF".into(),
        _ => match e.raw_os_error() {
            Some(code) => format!("{:?}", nix::errno::Errno::from_raw(code)),
            None => format!("{:?}", e.kind()),
        },
    }
}
