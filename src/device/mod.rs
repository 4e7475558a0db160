//! The device side: identity, MLS storage and the OpenMLS provider.

pub mod identity;
pub mod provider;
pub mod storage;
