//! The per-Service traffic readings of the agent's loop, taken on a blocking thread: the dump
//! of a large node's iptables tables (or the batch read of the eBPF counters) would otherwise
//! hold up every change that arrives meanwhile. The loop starts a reading, keeps syncing, and
//! takes the result when it is back — for iptables, without the samples of chains a restore
//! rewrote meanwhile (`IptablesDataplane::settle_traffic`).

use std::path::PathBuf;

use proxy_dataplane_ebpf::traffic::TrafficReader;
use proxy_dataplane_iptables::TrafficRead;
use proxy_model::traffic::TrafficReading;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::dataplane::Dataplane;

/// What a reading brings back.
#[derive(Debug)]
pub enum Taken {
    /// The reader goes back to the loop for the next reading, unless it failed (the pins may
    /// have been replaced by a `--cleanup`: opened again next time).
    Ebpf(Box<TrafficReader>, Result<TrafficReading, String>),
    Iptables(Result<TrafficRead, String>),
}

/// The reading in flight, and the eBPF reader between readings.
#[derive(Debug)]
pub struct TrafficReads {
    pin_dir: PathBuf,
    reader: Option<Box<TrafficReader>>,
    in_flight: Option<JoinHandle<Taken>>,
}

impl TrafficReads {
    pub fn new(pin_dir: PathBuf) -> Self {
        Self {
            pin_dir,
            reader: None,
            in_flight: None,
        }
    }

    pub fn idle(&self) -> bool {
        self.in_flight.is_none()
    }

    /// Starts a reading unless one is in flight.
    pub fn start(&mut self, dataplane: &Dataplane) {
        if self.in_flight.is_some() {
            return;
        }
        let task = match dataplane {
            Dataplane::Ebpf(_) => {
                let mut reader = match self.reader.take() {
                    Some(reader) => reader,
                    None => match TrafficReader::open(&self.pin_dir) {
                        Ok(reader) => Box::new(reader),
                        Err(error) => {
                            warn!(%error, "cannot open the per-Service traffic counters");
                            return;
                        }
                    },
                };
                tokio::task::spawn_blocking(move || {
                    let reading = reader.read().map_err(|error| error.to_string());
                    Taken::Ebpf(reader, reading)
                })
            }
            Dataplane::Iptables(iptables) => {
                let input = iptables.traffic_input();
                tokio::task::spawn_blocking(move || {
                    Taken::Iptables(input.read().map_err(|error| error.to_string()))
                })
            }
        };
        self.in_flight = Some(task);
    }

    /// The reading in flight, when it is back (pending forever when there is none).
    pub async fn done(&mut self) -> Option<Taken> {
        let Some(task) = self.in_flight.as_mut() else {
            return std::future::pending().await;
        };
        let taken = task.await;
        self.in_flight = None;
        match taken {
            Ok(taken) => Some(taken),
            Err(error) => {
                warn!(%error, "the per-Service traffic reading did not finish");
                None
            }
        }
    }

    /// The reading as the metrics take it; `Err` when it failed (logged by the caller).
    pub fn finish(
        &mut self,
        taken: Taken,
        dataplane: &Dataplane,
    ) -> Result<TrafficReading, String> {
        match (taken, dataplane) {
            (Taken::Ebpf(reader, reading), _) => {
                if reading.is_ok() {
                    self.reader = Some(reader);
                }
                reading
            }
            (Taken::Iptables(read), Dataplane::Iptables(iptables)) => {
                read.map(|read| iptables.settle_traffic(read))
            }
            // The dataplane is fixed for the agent's life; nothing to settle against.
            (Taken::Iptables(_), Dataplane::Ebpf(_)) => Ok(TrafficReading::default()),
        }
    }
}
