//! The HTTP servers kube-proxy exposes on the node network, one role: [`http`] is the shared
//! HTTP/1 layer (accepting, connection limits, timeouts, methods), [`health`] the proxier's
//! health state with the `/healthz`–`/livez` server and the metrics server, and
//! [`healthcheck`] the per-Service health-check node ports.

pub mod health;
pub mod healthcheck;
pub mod http;
