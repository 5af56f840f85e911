//! Wire formats: the frame header on physical links ([`frame`]) and the messages between a
//! layer and its node agent, and between agents ([`agent`]).

pub mod agent;
pub mod frame;
