//! One tunnel's ordering, flow control and resending, as a plain state
//! machine: no I/O, no clock of its own (callers pass `now_ms`), no crypto.
//!
//! Each direction is a numbered run of chunks. A message is cut into chunks
//! of at most [`MAX_CHUNK`] bytes, the last one marked. The receiver takes a
//! chunk only when it is the next number (go-back-N): a chunk after a gap
//! (a hub that lost frames in a rewind) is dropped, and the sender's resend
//! fills the gap in order. The receiver acknowledges cumulatively, and only
//! what it handed to the app, so a reader that stops reading stops the
//! acks, and the sender stops at [`WINDOW`] chunks unacknowledged: that is
//! the flow control. Nothing is delivered twice, because a chunk below the
//! next number is only acknowledged again.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Largest chunk of a message in one frame. A hub takes payloads up to
/// 1 MiB by default; a chunk and its framing stay well under.
pub const MAX_CHUNK: usize = 256 * 1024;

/// Chunks one direction may have sent and not yet had acknowledged.
pub const WINDOW: usize = 16;

/// Largest message a tunnel carries (the receiver reassembles it in
/// memory, so it is bounded).
pub const MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// First wait for an acknowledgment before sending the unacknowledged
/// chunks again; it doubles while nothing is acknowledged, up to
/// [`RESEND_MAX_MS`].
pub const RESEND_MIN_MS: u64 = 1_000;

/// Longest wait between two resends.
pub const RESEND_MAX_MS: u64 = 16_000;

/// What one frame of a tunnel carries, once opened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    /// Chunk `seq` of this direction; `last` ends a message.
    Data {
        /// The chunk's number in its direction, from 0.
        seq: u64,
        /// Whether this chunk ends a message.
        last: bool,
        /// The chunk's bytes.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
    /// Every chunk below `next` of the other direction reached the app.
    Ack {
        /// The next chunk number the receiver waits for.
        next: u64,
    },
    /// The sender closed the tunnel, and why.
    Close {
        /// Why, for the other side's [`super::CloseReason::Remote`].
        reason: String,
    },
}

/// What [`Session::receive`] found in a frame.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Received {
    /// Whole messages, in order, now the app's.
    pub messages: Vec<Vec<u8>>,
    /// The other side closed the tunnel (with its reason).
    pub closed: Option<String>,
    /// The frame moved nothing (a duplicate, a chunk after a gap, an old
    /// ack).
    pub stale: bool,
}

/// Why a message cannot be queued.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// Larger than [`MAX_MESSAGE`].
    #[error("a message of {len} bytes is larger than a tunnel carries ({max})")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The tunnel is closed.
    #[error("the tunnel is closed")]
    Closed,
}

/// One tunnel's state, both directions.
#[derive(Debug, Default)]
pub struct Session {
    /// Chunks queued, not yet sent (beyond the window).
    queued: VecDeque<(bool, Vec<u8>)>,
    /// Sent and not yet acknowledged, from number `acked`.
    in_flight: VecDeque<(bool, Vec<u8>)>,
    /// Every chunk below this was acknowledged.
    acked: u64,
    /// When the oldest unacknowledged chunk was last sent, or the last ack
    /// moved.
    sent_at_ms: u64,
    /// The current resend wait.
    resend_ms: u64,
    /// The next chunk number expected from the other side.
    next_in: u64,
    /// Chunks of the message being reassembled.
    partial: Vec<u8>,
    /// An acknowledgment is owed (chunks were taken since the last one).
    ack_owed: bool,
    /// When anything was last sent or received.
    active_ms: u64,
    closed: bool,
    /// This side's close, not yet sent.
    close_frame: Option<Frame>,
}

impl Session {
    /// A fresh tunnel, active from `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        Self {
            resend_ms: RESEND_MIN_MS,
            active_ms: now_ms,
            sent_at_ms: now_ms,
            ..Self::default()
        }
    }

    /// Queue `message` for sending.
    ///
    /// # Errors
    /// `TooLarge`, `Closed`; nothing is queued then.
    pub fn queue(&mut self, message: &[u8]) -> Result<(), QueueError> {
        if self.closed {
            return Err(QueueError::Closed);
        }
        if message.len() > MAX_MESSAGE {
            return Err(QueueError::TooLarge {
                len: message.len(),
                max: MAX_MESSAGE,
            });
        }
        if message.is_empty() {
            self.queued.push_back((true, Vec::new()));
            return Ok(());
        }
        let mut chunks = message.chunks(MAX_CHUNK).peekable();
        while let Some(c) = chunks.next() {
            self.queued.push_back((chunks.peek().is_none(), c.to_vec()));
        }
        Ok(())
    }

    /// Chunks queued or in flight: what the sender still owes the other
    /// side.
    pub fn unacknowledged(&self) -> usize {
        self.queued.len() + self.in_flight.len()
    }

    /// Whether more may be queued without growing past the window: a
    /// sender waits while this is false.
    pub fn has_room(&self) -> bool {
        self.unacknowledged() < WINDOW
    }

    /// The frames to send now: an owed ack, new chunks within the window,
    /// and, when nothing was acknowledged for the resend wait, every
    /// unacknowledged chunk again.
    pub fn transmit(&mut self, now_ms: u64) -> Vec<Frame> {
        let mut out = Vec::new();
        if self.closed {
            return out;
        }
        if self.ack_owed {
            self.ack_owed = false;
            out.push(Frame::Ack { next: self.next_in });
        }
        if !self.in_flight.is_empty() && now_ms >= self.sent_at_ms + self.resend_ms {
            for (i, (last, bytes)) in self.in_flight.iter().enumerate() {
                out.push(Frame::Data {
                    seq: self.acked + i as u64,
                    last: *last,
                    bytes: bytes.clone(),
                });
            }
            self.sent_at_ms = now_ms;
            self.resend_ms = (self.resend_ms * 2).min(RESEND_MAX_MS);
        }
        let mut fresh = false;
        while self.in_flight.len() < WINDOW {
            let Some((last, bytes)) = self.queued.pop_front() else {
                break;
            };
            fresh = true;
            if self.in_flight.is_empty() {
                self.sent_at_ms = now_ms;
            }
            out.push(Frame::Data {
                seq: self.acked + self.in_flight.len() as u64,
                last,
                bytes: bytes.clone(),
            });
            self.in_flight.push_back((last, bytes));
        }
        // Only new data is activity: acks and resends to a side that
        // stopped answering must not keep the tunnel open for ever.
        if fresh {
            self.active_ms = now_ms;
        }
        out
    }

    /// When [`Session::transmit`] has a resend to make, if anything is in
    /// flight.
    pub fn resend_due_ms(&self) -> Option<u64> {
        (!self.in_flight.is_empty() && !self.closed).then_some(self.sent_at_ms + self.resend_ms)
    }

    /// Take a frame from the other side.
    ///
    /// # Errors
    /// A message larger than [`MAX_MESSAGE`] being reassembled: the tunnel
    /// is then unusable and should be closed.
    pub fn receive(&mut self, frame: Frame, now_ms: u64) -> Result<Received, QueueError> {
        let mut r = Received::default();
        if self.closed {
            r.stale = true;
            return Ok(r);
        }
        self.active_ms = now_ms;
        match frame {
            Frame::Data { seq, last, bytes } => {
                if seq != self.next_in {
                    // A duplicate is acknowledged again (the sender may have
                    // missed the ack); a chunk after a gap waits for the
                    // resend of what is missing.
                    if seq < self.next_in {
                        self.ack_owed = true;
                    }
                    r.stale = true;
                    return Ok(r);
                }
                if self.partial.len() + bytes.len() > MAX_MESSAGE {
                    return Err(QueueError::TooLarge {
                        len: self.partial.len() + bytes.len(),
                        max: MAX_MESSAGE,
                    });
                }
                self.next_in += 1;
                self.ack_owed = true;
                self.partial.extend_from_slice(&bytes);
                if last {
                    r.messages.push(std::mem::take(&mut self.partial));
                }
            }
            Frame::Ack { next } => {
                let sent = self.acked + self.in_flight.len() as u64;
                if next <= self.acked || next > sent {
                    r.stale = true;
                    return Ok(r);
                }
                for _ in self.acked..next {
                    self.in_flight.pop_front();
                }
                self.acked = next;
                self.sent_at_ms = now_ms;
                self.resend_ms = RESEND_MIN_MS;
            }
            Frame::Close { reason } => {
                self.closed = true;
                r.closed = Some(reason);
            }
        }
        Ok(r)
    }

    /// Close this side: nothing more is sent or taken, and the frame that
    /// tells the other side waits in [`Session::transmit_close`]. Answers
    /// whether it was open (a tunnel the other side closed is not told
    /// back).
    pub fn close(&mut self, reason: &str) -> bool {
        if self.closed {
            return false;
        }
        self.closed = true;
        self.queued.clear();
        self.in_flight.clear();
        self.close_frame = Some(Frame::Close {
            reason: reason.to_string(),
        });
        true
    }

    /// The close frame owed to the other side, once.
    pub fn transmit_close(&mut self) -> Option<Frame> {
        self.close_frame.take()
    }

    /// Make the next [`Session::transmit`] send every unacknowledged chunk
    /// again (a publish failed: the hub may have missed what followed).
    pub fn resend_soon(&mut self, now_ms: u64) {
        self.sent_at_ms = now_ms.saturating_sub(self.resend_ms);
    }

    /// Whether the tunnel is closed (either side).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// How long nothing was received and no new data sent, at `now_ms`
    /// (resends and acks do not count: a side that stopped answering lets
    /// the tunnel go idle however long the other resends).
    pub fn idle_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.active_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Carry every frame of `from` to `to`, answering what `to` owes back;
    /// returns the messages `to` got.
    fn carry(from: &mut Session, to: &mut Session, now: u64) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        loop {
            let frames = from.transmit(now);
            if frames.is_empty() {
                return got;
            }
            for f in frames {
                got.extend(to.receive(f, now).unwrap().messages);
            }
            for f in to.transmit(now) {
                from.receive(f, now).unwrap();
            }
        }
    }

    #[test]
    fn messages_arrive_whole_and_in_order_across_chunks() {
        let (mut a, mut b) = (Session::new(0), Session::new(0));
        let big: Vec<u8> = (0..MAX_CHUNK * 3 + 7).map(|i| i as u8).collect();
        a.queue(b"one").unwrap();
        a.queue(&big).unwrap();
        a.queue(b"").unwrap();
        a.queue(b"three").unwrap();
        let got = carry(&mut a, &mut b, 0);
        assert_eq!(
            got,
            vec![b"one".to_vec(), big, Vec::new(), b"three".to_vec()]
        );
        assert_eq!(a.unacknowledged(), 0);
    }

    #[test]
    fn the_window_stops_the_sender_until_the_receiver_acknowledges() {
        let (mut a, mut b) = (Session::new(0), Session::new(0));
        for i in 0..WINDOW as u8 + 5 {
            a.queue(&[i]).unwrap();
        }
        assert!(!a.has_room());
        let first = a.transmit(0);
        assert_eq!(first.len(), WINDOW, "no more than the window in flight");
        assert!(
            a.transmit(10).is_empty(),
            "nothing before an ack or the wait"
        );
        for f in first {
            b.receive(f, 1).unwrap();
        }
        let acks = b.transmit(1);
        assert_eq!(
            acks,
            vec![Frame::Ack {
                next: WINDOW as u64
            }]
        );
        a.receive(acks[0].clone(), 2).unwrap();
        assert_eq!(a.transmit(2).len(), 5, "the rest goes once acknowledged");
    }

    #[test]
    fn lost_chunks_are_sent_again_and_nothing_arrives_twice() {
        let (mut a, mut b) = (Session::new(0), Session::new(0));
        for i in 0..4u8 {
            a.queue(&[i]).unwrap();
        }
        let frames = a.transmit(0);
        // The hub lost the second chunk: the third and fourth wait.
        let mut got = Vec::new();
        for (i, f) in frames.into_iter().enumerate() {
            if i != 1 {
                let r = b.receive(f, 0).unwrap();
                assert_eq!(r.stale, i > 1);
                got.extend(r.messages);
            }
        }
        assert_eq!(got, vec![vec![0]]);
        for f in b.transmit(0) {
            a.receive(f, 0).unwrap();
        }
        assert!(a.transmit(RESEND_MIN_MS - 1).is_empty());
        let again = a.transmit(RESEND_MIN_MS);
        assert_eq!(again.len(), 3, "every unacknowledged chunk again");
        for f in again.iter().cloned().chain(again.iter().cloned()) {
            got.extend(b.receive(f, RESEND_MIN_MS).unwrap().messages);
        }
        assert_eq!(got, vec![vec![0], vec![1], vec![2], vec![3]]);
        for f in b.transmit(RESEND_MIN_MS) {
            a.receive(f, RESEND_MIN_MS).unwrap();
        }
        assert_eq!(a.unacknowledged(), 0);
    }

    #[test]
    fn resends_back_off_while_nothing_is_acknowledged() {
        let mut a = Session::new(0);
        a.queue(b"x").unwrap();
        a.transmit(0);
        let mut at = 0;
        let mut waits = Vec::new();
        for _ in 0..7 {
            let due = a.resend_due_ms().unwrap();
            waits.push(due - at);
            at = due;
            assert_eq!(a.transmit(due).len(), 1);
        }
        assert_eq!(
            waits,
            vec![1_000, 2_000, 4_000, 8_000, 16_000, 16_000, 16_000]
        );
    }

    #[test]
    fn acks_out_of_range_move_nothing() {
        let (mut a, mut b) = (Session::new(0), Session::new(0));
        a.queue(b"x").unwrap();
        a.transmit(0);
        assert!(a.receive(Frame::Ack { next: 5 }, 0).unwrap().stale);
        assert!(a.receive(Frame::Ack { next: 0 }, 0).unwrap().stale);
        assert_eq!(a.unacknowledged(), 1);
        // A chunk from the future is not taken.
        let r = b
            .receive(
                Frame::Data {
                    seq: 3,
                    last: true,
                    bytes: vec![1],
                },
                0,
            )
            .unwrap();
        assert!(r.stale && r.messages.is_empty());
    }

    #[test]
    fn closing_tells_the_other_side_once_and_stops_both() {
        let (mut a, mut b) = (Session::new(0), Session::new(0));
        a.queue(b"x").unwrap();
        assert!(a.close("done"));
        assert!(!a.close("again"));
        let close = a.transmit_close().unwrap();
        assert_eq!(a.transmit_close(), None, "told once");
        assert!(a.transmit(0).is_empty());
        assert_eq!(a.queue(b"y"), Err(QueueError::Closed));
        let r = b.receive(close, 0).unwrap();
        assert_eq!(r.closed.as_deref(), Some("done"));
        assert!(b.is_closed());
        assert_eq!(b.queue(b"z"), Err(QueueError::Closed));
        assert!(!b.close("back"), "a tunnel closed by the other side");
        assert_eq!(b.transmit_close(), None, "is not told back");
    }

    #[test]
    fn a_message_past_the_bound_is_refused() {
        let mut a = Session::new(0);
        let e = a.queue(&vec![0; MAX_MESSAGE + 1]).unwrap_err();
        assert!(matches!(e, QueueError::TooLarge { .. }));
        assert_eq!(a.unacknowledged(), 0);
    }

    #[test]
    fn idleness_counts_from_the_last_frame_either_way() {
        let (mut a, mut b) = (Session::new(0), Session::new(0));
        assert_eq!(a.idle_ms(500), 500);
        a.queue(b"x").unwrap();
        let f = a.transmit(700);
        assert_eq!(a.idle_ms(800), 100);
        b.receive(f[0].clone(), 900).unwrap();
        assert_eq!(b.idle_ms(1000), 100);
    }

    #[test]
    fn resends_to_a_silent_side_do_not_keep_a_tunnel_busy() {
        let mut a = Session::new(0);
        a.queue(b"x").unwrap();
        assert_eq!(a.transmit(100).len(), 1);
        // Nothing comes back: the chunk goes again and again.
        let mut now = 100;
        for _ in 0..5 {
            now += RESEND_MAX_MS;
            assert!(!a.transmit(now).is_empty(), "resent at {now}");
        }
        assert_eq!(a.idle_ms(now), now - 100);
    }
}
