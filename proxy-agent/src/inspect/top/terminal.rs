//! The terminal of an interactive `inspect top`, with plain ANSI sequences and termios: keys
//! one at a time without echo, the alternate screen, and everything put back when dropped.

use std::{
    fs::File,
    io::{self, Read as _, Write as _},
    os::fd::AsFd as _,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

/// Set by SIGTERM or SIGHUP while the terminal is raw: the view ends as on `q`, so that the
/// terminal is put back, which the signals' default action would not do.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// How long a wait for keys lasts at most, so that a stop signal that another thread took is
/// seen soon.
const STOP_CHECK: Duration = Duration::from_millis(200);

/// Raw keys and the alternate screen while it lives.
pub struct RawTerminal {
    saved: libc::termios,
    /// stdin, unbuffered: a buffered reader would keep keys `poll` no longer reports.
    input: File,
    /// stdin said end of file: no more keys, only the timer.
    input_closed: bool,
}

const STDIN: libc::c_int = 0;
const STDOUT: libc::c_int = 1;

impl RawTerminal {
    /// Switches stdin to keys without echo or line editing (Ctrl-C is a key too: the view
    /// quits on it and puts the terminal back, which a signal's default action would not) and
    /// stdout to the alternate screen, cursor hidden.
    pub fn enter() -> io::Result<Self> {
        // SAFETY: a zeroed termios is a valid value for tcgetattr to overwrite.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 and a valid, exclusively borrowed termios.
        if unsafe { libc::tcgetattr(STDIN, &mut saved) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut raw = saved;
        raw.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG | libc::IEXTEN);
        raw.c_iflag &= !(libc::IXON | libc::ICRNL);
        raw.c_cc[libc::VMIN] = 1;
        raw.c_cc[libc::VTIME] = 0;
        // SAFETY: fd 0 and a valid termios.
        if unsafe { libc::tcsetattr(STDIN, libc::TCSANOW, &raw) } != 0 {
            return Err(io::Error::last_os_error());
        }
        for signal in [libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
        let terminal = Self {
            saved,
            input: File::from(io::stdin().as_fd().try_clone_to_owned()?),
            input_closed: false,
        };
        let mut out = io::stdout().lock();
        out.write_all(b"\x1b[?1049h\x1b[?25l\x1b[2J")?;
        out.flush()?;
        Ok(terminal)
    }

    /// Columns and lines of the terminal; 80×24 when it does not say.
    pub fn size() -> (usize, usize) {
        // SAFETY: a zeroed winsize is a valid value for the ioctl to overwrite.
        let mut size: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes one winsize into the valid, exclusively borrowed `size`.
        let ok = unsafe { libc::ioctl(STDOUT, libc::TIOCGWINSZ, &mut size) } == 0;
        if ok && size.ws_col > 0 && size.ws_row > 0 {
            (usize::from(size.ws_col), usize::from(size.ws_row))
        } else {
            (80, 24)
        }
    }

    /// Draws a frame from the top left, each line cleared to its end and the rest of the screen
    /// below it: no flicker, no leftovers of a longer frame.
    pub fn draw(&self, frame: &str) -> io::Result<()> {
        let mut text = String::with_capacity(frame.len() + 64);
        text.push_str("\x1b[H");
        for (i, line) in frame.lines().enumerate() {
            if i > 0 {
                text.push_str("\r\n");
            }
            text.push_str(line);
            text.push_str("\x1b[K");
        }
        text.push_str("\x1b[J");
        let mut out = io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()
    }

    /// Whether SIGTERM or SIGHUP came.
    pub fn stopped() -> bool {
        STOP.load(Ordering::Relaxed)
    }

    /// The keys typed within `timeout` (empty when none was), waiting at most `STOP_CHECK`.
    pub fn keys(&mut self, timeout: Duration) -> io::Result<Vec<u8>> {
        let timeout = timeout.min(STOP_CHECK);
        if self.input_closed {
            std::thread::sleep(timeout);
            return Ok(Vec::new());
        }
        let mut poll = libc::pollfd {
            fd: STDIN,
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid, exclusively borrowed pollfd.
        let ready = unsafe { libc::poll(&mut poll, 1, millis) };
        if ready < 0 {
            let error = io::Error::last_os_error();
            return if error.kind() == io::ErrorKind::Interrupted {
                Ok(Vec::new())
            } else {
                Err(error)
            };
        }
        if ready == 0 {
            return Ok(Vec::new());
        }
        let mut buf = [0u8; 64];
        let n = self.input.read(&mut buf)?;
        if n == 0 {
            self.input_closed = true;
        }
        Ok(buf[..n].to_vec())
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        let mut out = io::stdout().lock();
        let _ = out.write_all(b"\x1b[?25h\x1b[?1049l");
        let _ = out.flush();
        // SAFETY: fd 0 and the termios it had before.
        unsafe { libc::tcsetattr(STDIN, libc::TCSANOW, &self.saved) };
    }
}
