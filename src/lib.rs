//! hubsync: end-to-end encrypted group sync over MLS through untrusted hubs.
//!
//! The crate holds both sides: the hub server ([`hub`]) and the device library
//! ([`device`]), which talk the [`wire`] protocol through a [`client::HubClient`].
//! Every persistent part sits behind the one [`kv::KvStore`] trait, every
//! transport behind [`transport`], every wall-clock read behind [`clock`] and
//! every random draw behind [`rng`], so the simulation runs this very code.

pub mod bench;
pub mod client;
pub mod clock;
pub mod device;
#[doc(hidden)]
pub mod fuzz;
pub mod hub;
pub mod kv;
mod process;
mod prom;
pub mod rng;
pub mod soak;
pub mod testkit;
pub mod transport;
pub mod wire;
