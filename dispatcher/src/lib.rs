//! The dispatcher: the control loop between the queue and the runtimes.
//!
//! Not built yet (issue 5 and later). It will claim jobs with a lease, place them on a
//! node pool (spot GPU, on-demand GPU, Xeon CPU), start attempts as local processes or
//! Kubernetes Jobs, detect preemption, requeue and resume from the last checkpoint, and
//! deliver signed webhooks.
