//! The hub's limits and its token-bucket rate limiter.

use crate::wire::{DeviceId, HubError, TopicId};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// A token bucket's shape: a sustained rate and a burst.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    /// Tokens added per second.
    pub per_sec: f64,
    /// Bucket capacity.
    pub burst: f64,
}

/// Every limit a hub enforces; each answers a named [`HubError`].
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Largest payload of one publish (`PayloadTooLarge`).
    pub max_payload: usize,
    /// Longest topic id (`BadTopic`).
    pub max_topic: usize,
    /// Publishes, subscribes and key-package calls per device (`RateLimited`).
    pub device_rate: Rate,
    /// Publishes per topic (`RateLimited`).
    pub topic_rate: Rate,
    /// Subscription changes per device, in topics whose subscription was
    /// written (created, changed or dropped), plus one per request
    /// (`RateLimited { scope: "subscriptions" }`). Apart from
    /// `device_rate`, so following many groups never spends publish rate,
    /// and re-subscribing what is already subscribed (after a reconnect)
    /// costs one token per request.
    pub subscription_rate: Rate,
    /// Subscriptions per device (`TooManySubscriptions`). A device follows
    /// 3 topics of a group on its commit hub (13 at worst, right after ten
    /// roster changes in a row), so the default lets it follow more than a
    /// thousand groups.
    pub max_subscriptions: u32,
    /// Log frames held per topic; a deeper log is trimmed from its oldest end,
    /// and readers behind the trim see `gap`.
    pub max_log_depth: u64,
    /// Retention when a publish or subscribe names none.
    pub default_retention: Duration,
    /// Largest retention a publish or subscribe may name (`RetentionTooLong`).
    pub max_retention: Duration,
    /// Largest `limit` of one fetch (`BadFetchLimit`).
    pub max_fetch: u32,
    /// Most frames in one ack (`TooManyAcks`).
    pub max_acks: usize,
    /// Key packages in one device's pool (`KeyPackagePoolFull`).
    pub max_key_packages: u32,
    /// Largest key package (`BadKeyPackage`).
    pub max_key_package_bytes: usize,
    /// Posts to one device's mailbox by one sender, per (sender, mailbox)
    /// pair (`RateLimited { scope: "mailbox" }`), on top of the device and
    /// topic buckets.
    pub mailbox_rate: Rate,
    /// Key-package claims by one claimer, whatever the target
    /// (`RateLimited { scope: "claimer" }`), on top of its device bucket.
    pub claimer_rate: Rate,
    /// Key-package claims of one target's packages, by all claimers
    /// together (`RateLimited { scope: "target" }`), so nobody drains a
    /// pool in one burst.
    pub target_rate: Rate,
    /// Frames one device's own mailbox holds that the device has not
    /// acknowledged. A post to a full mailbox is refused (`MailboxFull`),
    /// stores nothing, and is counted in `HubMetrics::mailbox_full`; the
    /// poster tries again later. Log topics have no such bound: a slow
    /// subscriber falls behind in the log itself, which its depth and
    /// retention bound.
    pub max_mailbox_frames: u64,
    /// Payload bytes one device may have stored on the hub: the log and
    /// mailbox frames it published that are still held
    /// (`StorageQuotaExceeded`).
    pub max_stored_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload: 1 << 20,
            max_topic: 256,
            device_rate: Rate {
                per_sec: 20.0,
                burst: 50.0,
            },
            topic_rate: Rate {
                per_sec: 100.0,
                burst: 200.0,
            },
            subscription_rate: Rate {
                per_sec: 100.0,
                burst: 20_000.0,
            },
            max_subscriptions: 20_000,
            max_log_depth: 100_000,
            default_retention: Duration::from_secs(7 * 24 * 3600),
            max_retention: Duration::from_secs(30 * 24 * 3600),
            max_fetch: 500,
            max_acks: 1000,
            max_key_packages: 100,
            max_key_package_bytes: 16 * 1024,
            mailbox_rate: Rate {
                per_sec: 1.0,
                burst: 20.0,
            },
            claimer_rate: Rate {
                per_sec: 1.0,
                burst: 30.0,
            },
            target_rate: Rate {
                per_sec: 10.0 / 60.0,
                burst: 10.0,
            },
            max_mailbox_frames: 10_000,
            max_stored_bytes: 1 << 30,
        }
    }
}

impl Limits {
    /// Limits with rates and per-device quotas high enough never to
    /// trigger: for tests and benchmarks that measure something else, and
    /// for a device's own loopback hub. Sizes, depths and retention stay
    /// the defaults.
    pub fn unthrottled() -> Self {
        let fast = Rate {
            per_sec: 1e9,
            burst: 1e9,
        };
        Self {
            device_rate: fast,
            topic_rate: fast,
            mailbox_rate: fast,
            claimer_rate: fast,
            target_rate: fast,
            subscription_rate: fast,
            max_mailbox_frames: u64::MAX,
            max_stored_bytes: u64::MAX,
            ..Self::default()
        }
    }

    /// The largest WebSocket message the hub reads: a full payload plus room
    /// for the frame's other fields.
    pub fn max_frame(&self) -> usize {
        self.max_payload + self.max_topic + 64 * 1024
    }

    /// Check the limits against each other.
    ///
    /// # Errors
    /// A sentence naming the limit that makes no sense.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_topic == 0 || self.max_topic > u16::MAX as usize {
            return Err(format!(
                "max_topic must be 1..=65535, not {}",
                self.max_topic
            ));
        }
        if self.default_retention > self.max_retention {
            return Err("default retention exceeds the maximum retention".into());
        }
        if self.max_log_depth == 0 || self.max_fetch == 0 || self.max_acks == 0 {
            return Err("log depth, fetch limit and ack limit must be at least 1".into());
        }
        if self.max_mailbox_frames == 0 || self.max_stored_bytes == 0 {
            return Err("mailbox frames and stored bytes per device must be at least 1".into());
        }
        for (name, r) in [
            ("device", self.device_rate),
            ("topic", self.topic_rate),
            ("mailbox", self.mailbox_rate),
            ("claimer", self.claimer_rate),
            ("target", self.target_rate),
            ("subscription", self.subscription_rate),
        ] {
            if r.per_sec.is_nan() || r.per_sec <= 0.0 || r.burst.is_nan() || r.burst < 1.0 {
                return Err(format!("{name} rate needs per_sec > 0 and burst >= 1"));
            }
        }
        Ok(())
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

struct Buckets<K> {
    rate: Rate,
    map: HashMap<K, Bucket>,
}

impl<K: Hash + Eq + Clone> Buckets<K> {
    fn new(rate: Rate) -> Self {
        Self {
            rate,
            map: HashMap::new(),
        }
    }

    fn refill(&self, b: &mut Bucket, now: Instant) {
        let dt = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + dt * self.rate.per_sec).min(self.rate.burst);
        b.at = now;
    }

    /// Milliseconds until a token is available, or 0 when one is now.
    fn wait_ms(&mut self, k: &K, now: Instant) -> u64 {
        let burst = self.rate.burst;
        let mut b = self.map.remove(k).unwrap_or(Bucket {
            tokens: burst,
            at: now,
        });
        self.refill(&mut b, now);
        let wait = if b.tokens >= 1.0 {
            0
        } else {
            (((1.0 - b.tokens) / self.rate.per_sec) * 1000.0).ceil() as u64
        };
        self.map.insert(k.clone(), b);
        wait
    }

    fn take(&mut self, k: &K) {
        if let Some(b) = self.map.get_mut(k) {
            b.tokens -= 1.0;
        }
    }

    /// Take `n` more tokens from `k`'s bucket, into debt if it has fewer
    /// (at most one burst deep): the next request waits until it is
    /// paid off.
    fn charge(&mut self, k: &K, n: f64, now: Instant) {
        let burst = self.rate.burst;
        let mut b = self.map.remove(k).unwrap_or(Bucket {
            tokens: burst,
            at: now,
        });
        self.refill(&mut b, now);
        b.tokens = (b.tokens - n).max(-burst);
        self.map.insert(k.clone(), b);
    }

    /// Forget buckets that are full again: they behave exactly like new ones.
    fn prune(&mut self, now: Instant) {
        let rate = self.rate;
        self.map.retain(|_, b| {
            let dt = now.saturating_duration_since(b.at).as_secs_f64();
            b.tokens + dt * rate.per_sec < rate.burst
        });
    }
}

/// One bucket a request takes a token from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RateKey<'a> {
    /// Everything one device does (`device`).
    Device(&'a DeviceId),
    /// Publishes to one topic, by anyone (`topic`).
    Topic(&'a TopicId),
    /// Posts by `sender` to the mailbox of `owner` (`mailbox`).
    Mailbox {
        /// Who posts.
        sender: &'a DeviceId,
        /// Whose mailbox.
        owner: &'a DeviceId,
    },
    /// Key-package claims by one claimer (`claimer`).
    Claimer(&'a DeviceId),
    /// Key-package claims of one target's packages (`target`).
    Target(&'a DeviceId),
    /// Subscription changes of one device (`subscriptions`).
    Subscriptions(&'a DeviceId),
}

struct AllBuckets {
    devices: Buckets<DeviceId>,
    topics: Buckets<TopicId>,
    mailboxes: Buckets<(DeviceId, DeviceId)>,
    claimers: Buckets<DeviceId>,
    targets: Buckets<DeviceId>,
    subscriptions: Buckets<DeviceId>,
    refused: RateLimitRefusals,
}

/// Requests refused with `RateLimited`, by the scope of the bucket that
/// was empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateLimitRefusals {
    /// A device's own bucket (publishes, subscribes, key-package calls).
    pub device: u64,
    /// A topic's bucket (publishes to it, all devices together).
    pub topic: u64,
    /// A (sender, mailbox) pair's bucket.
    pub mailbox: u64,
    /// A claimer's key-package claims.
    pub claimer: u64,
    /// Claims of one device's key packages, all claimers together.
    pub target: u64,
    /// A device's subscription changes.
    pub subscriptions: u64,
}

impl RateLimitRefusals {
    fn count(&mut self, scope: &str) {
        let n = match scope {
            "device" => &mut self.device,
            "topic" => &mut self.topic,
            "mailbox" => &mut self.mailbox,
            "claimer" => &mut self.claimer,
            "subscriptions" => &mut self.subscriptions,
            _ => &mut self.target,
        };
        *n += 1;
    }

    /// Every scope with its count, in a fixed order.
    pub fn by_scope(&self) -> [(&'static str, u64); 6] {
        [
            ("device", self.device),
            ("topic", self.topic),
            ("mailbox", self.mailbox),
            ("claimer", self.claimer),
            ("target", self.target),
            ("subscriptions", self.subscriptions),
        ]
    }
}

impl AllBuckets {
    /// Milliseconds until `key`'s bucket has a token, and its scope name.
    fn wait_ms(&mut self, key: RateKey<'_>, now: Instant) -> (u64, &'static str) {
        match key {
            RateKey::Device(d) => (self.devices.wait_ms(d, now), "device"),
            RateKey::Topic(t) => (self.topics.wait_ms(t, now), "topic"),
            RateKey::Mailbox { sender, owner } => {
                (self.mailboxes.wait_ms(&(*sender, *owner), now), "mailbox")
            }
            RateKey::Claimer(d) => (self.claimers.wait_ms(d, now), "claimer"),
            RateKey::Target(d) => (self.targets.wait_ms(d, now), "target"),
            RateKey::Subscriptions(d) => (self.subscriptions.wait_ms(d, now), "subscriptions"),
        }
    }

    fn take(&mut self, key: RateKey<'_>) {
        match key {
            RateKey::Device(d) => self.devices.take(d),
            RateKey::Topic(t) => self.topics.take(t),
            RateKey::Mailbox { sender, owner } => self.mailboxes.take(&(*sender, *owner)),
            RateKey::Claimer(d) => self.claimers.take(d),
            RateKey::Target(d) => self.targets.take(d),
            RateKey::Subscriptions(d) => self.subscriptions.take(d),
        }
    }
}

/// Token buckets per device, topic, (sender, mailbox), claimer and claim
/// target, on tokio's clock.
pub(crate) struct RateLimiter {
    inner: Mutex<AllBuckets>,
}

impl RateLimiter {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            inner: Mutex::new(AllBuckets {
                devices: Buckets::new(limits.device_rate),
                topics: Buckets::new(limits.topic_rate),
                mailboxes: Buckets::new(limits.mailbox_rate),
                claimers: Buckets::new(limits.claimer_rate),
                targets: Buckets::new(limits.target_rate),
                subscriptions: Buckets::new(limits.subscription_rate),
                refused: RateLimitRefusals::default(),
            }),
        }
    }

    /// Take one token from each of `keys`' buckets, or, when any of them is
    /// empty, take none and name the first empty one (in the order given).
    pub(crate) fn check_all(&self, keys: &[RateKey<'_>]) -> Result<(), HubError> {
        let now = Instant::now();
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for key in keys {
            let (wait, scope) = g.wait_ms(*key, now);
            if wait > 0 {
                g.refused.count(scope);
                return Err(HubError::RateLimited {
                    scope: scope.into(),
                    retry_after_ms: wait,
                });
            }
        }
        for key in keys {
            g.take(*key);
        }
        Ok(())
    }

    /// Charge `device`'s subscription bucket `n` tokens more than the one
    /// [`RateLimiter::check_all`] took: the changes its request wrote,
    /// known only once the request ran. The bucket may go into debt.
    pub(crate) fn charge_subscriptions(&self, device: &DeviceId, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.subscriptions.charge(device, n as f64, now);
    }

    /// What was refused so far, by scope.
    pub(crate) fn refusals(&self) -> RateLimitRefusals {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).refused
    }

    /// Take one token from the device's bucket and, when given, the topic's.
    /// Takes nothing when either is empty.
    pub(crate) fn check(&self, device: &DeviceId, topic: Option<&TopicId>) -> Result<(), HubError> {
        match topic {
            Some(t) => self.check_all(&[RateKey::Device(device), RateKey::Topic(t)]),
            None => self.check_all(&[RateKey::Device(device)]),
        }
    }

    pub(crate) fn prune(&self) {
        let now = Instant::now();
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.devices.prune(now);
        g.topics.prune(now);
        g.mailboxes.prune(now);
        g.claimers.prune(now);
        g.targets.prune(now);
        g.subscriptions.prune(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bucket_allows_burst_then_rate() {
        let limits = Limits {
            device_rate: Rate {
                per_sec: 10.0,
                burst: 3.0,
            },
            ..Limits::default()
        };
        let rl = RateLimiter::new(&limits);
        let d = DeviceId([1; 32]);
        for _ in 0..3 {
            rl.check(&d, None).unwrap();
        }
        let Err(HubError::RateLimited { retry_after_ms, .. }) = rl.check(&d, None) else {
            panic!("fourth call within the burst must be limited");
        };
        assert_eq!(retry_after_ms, 100);
        tokio::time::advance(Duration::from_millis(100)).await;
        rl.check(&d, None).unwrap();
        // Another device has its own bucket.
        rl.check(&DeviceId([2; 32]), None).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_key_takes_no_token_from_the_others() {
        let limits = Limits {
            target_rate: Rate {
                per_sec: 1.0,
                burst: 1.0,
            },
            claimer_rate: Rate {
                per_sec: 1.0,
                burst: 2.0,
            },
            ..Limits::default()
        };
        let rl = RateLimiter::new(&limits);
        let (a, b, t) = (DeviceId([1; 32]), DeviceId([2; 32]), DeviceId([9; 32]));
        rl.check_all(&[RateKey::Claimer(&a), RateKey::Target(&t)])
            .unwrap();
        assert!(matches!(
            rl.check_all(&[RateKey::Claimer(&a), RateKey::Target(&t)]),
            Err(HubError::RateLimited { ref scope, .. }) if scope == "target"
        ));
        // The refused claim took no claimer token: one is left for another target.
        rl.check_all(&[RateKey::Claimer(&a), RateKey::Target(&b)])
            .unwrap();
        assert!(matches!(
            rl.check_all(&[RateKey::Claimer(&a)]),
            Err(HubError::RateLimited { ref scope, .. }) if scope == "claimer"
        ));
        // A mailbox bucket is per (sender, owner).
        let mb = Limits {
            mailbox_rate: Rate {
                per_sec: 1.0,
                burst: 1.0,
            },
            ..Limits::default()
        };
        let rl = RateLimiter::new(&mb);
        let key = |s| RateKey::Mailbox {
            sender: s,
            owner: &t,
        };
        rl.check_all(&[key(&a)]).unwrap();
        assert!(matches!(
            rl.check_all(&[key(&a)]),
            Err(HubError::RateLimited { ref scope, .. }) if scope == "mailbox"
        ));
        rl.check_all(&[key(&b)]).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn subscription_changes_are_charged_after_and_may_go_into_debt() {
        let limits = Limits {
            subscription_rate: Rate {
                per_sec: 10.0,
                burst: 5.0,
            },
            device_rate: Rate {
                per_sec: 1.0,
                burst: 1.0,
            },
            ..Limits::default()
        };
        let rl = RateLimiter::new(&limits);
        let d = DeviceId([1; 32]);
        let key = [RateKey::Subscriptions(&d)];
        rl.check_all(&key).unwrap();
        // Twenty written: the bucket owes one burst at most.
        rl.charge_subscriptions(&d, 20);
        assert!(matches!(
            rl.check_all(&key),
            Err(HubError::RateLimited { ref scope, retry_after_ms: 600 }) if scope == "subscriptions"
        ));
        assert_eq!(rl.refusals().subscriptions, 1);
        // The device's own bucket is another one.
        rl.check(&d, None).unwrap();
        tokio::time::advance(Duration::from_millis(600)).await;
        rl.check_all(&key).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn topic_limit_takes_no_device_token_when_refused() {
        let limits = Limits {
            topic_rate: Rate {
                per_sec: 1.0,
                burst: 1.0,
            },
            ..Limits::default()
        };
        let rl = RateLimiter::new(&limits);
        let t = TopicId::from("t");
        rl.check(&DeviceId([1; 32]), Some(&t)).unwrap();
        assert!(matches!(
            rl.check(&DeviceId([2; 32]), Some(&t)),
            Err(HubError::RateLimited { ref scope, .. }) if scope == "topic"
        ));
    }
}
