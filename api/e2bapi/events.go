package e2bapi

import (
	"encoding/json"
	"time"
)

// Lifecycle event types (E2B's events API and webhooks: the "type" field).
const (
	EventCreated      = "sandbox.lifecycle.created"
	EventKilled       = "sandbox.lifecycle.killed"
	EventUpdated      = "sandbox.lifecycle.updated"
	EventPaused       = "sandbox.lifecycle.paused"
	EventResumed      = "sandbox.lifecycle.resumed"
	EventCheckpointed = "sandbox.lifecycle.checkpointed"
)

// EventTypes are every lifecycle event type, in lifecycle order.
var EventTypes = []string{EventCreated, EventUpdated, EventPaused, EventResumed, EventCheckpointed, EventKilled}

// KnownEventType reports whether t is one of EventTypes.
func KnownEventType(t string) bool {
	for _, k := range EventTypes {
		if k == t {
			return true
		}
	}
	return false
}

// EventVersion is the "version" of the events SPACE records (E2B's
// current payload, with eventData.sandbox_metadata and .execution).
const EventVersion = "v2"

// SandboxEvent is one lifecycle event as GET /events/sandboxes[/{id}]
// returns it and a webhook delivery posts it.
type SandboxEvent struct {
	Version            string          `json:"version"`
	ID                 string          `json:"id"`
	Type               string          `json:"type"`
	EventData          json.RawMessage `json:"eventData"`
	SandboxBuildID     string          `json:"sandboxBuildId"`
	SandboxExecutionID string          `json:"sandboxExecutionId"`
	SandboxID          string          `json:"sandboxId"`
	SandboxTeamID      string          `json:"sandboxTeamId"`
	SandboxTemplateID  string          `json:"sandboxTemplateId"`
	Timestamp          time.Time       `json:"timestamp"`
}

// EventData is SandboxEvent.EventData as SPACE fills it. Execution is set
// on killed and paused events (as E2B documents); Reason says why
// (e.g. "timeout", "moved", "killed by API"); SPACE's own fields are
// Generation and WorkerID.
type EventData struct {
	SandboxMetadata map[string]string `json:"sandbox_metadata,omitempty"`
	Execution       *EventExecution   `json:"execution,omitempty"`
	Reason          string            `json:"reason,omitempty"`
	// Timeout is the sandbox's new end time (updated events).
	Timeout    *time.Time `json:"timeout,omitempty"`
	Generation uint64     `json:"generation,omitempty"`
	WorkerID   string     `json:"worker_id,omitempty"`
}

// EventExecution describes the execution an event ends.
type EventExecution struct {
	StartedAt time.Time `json:"started_at"`
	VCPUCount int       `json:"vcpu_count"`
	MemoryMB  int       `json:"memory_mb"`
	// ExecutionTime is the execution's run time in milliseconds.
	ExecutionTime int64 `json:"execution_time"`
}

// Webhook delivery headers.
const (
	HeaderWebhookID        = "e2b-webhook-id"
	HeaderDeliveryID       = "e2b-delivery-id"
	HeaderSignature        = "e2b-signature"
	HeaderSignatureVersion = "e2b-signature-version"
)

// NewWebhook is the body of POST /events/webhooks.
type NewWebhook struct {
	Name            string   `json:"name"`
	URL             string   `json:"url"`
	Enabled         *bool    `json:"enabled,omitempty"`
	Events          []string `json:"events"`
	SignatureSecret string   `json:"signatureSecret"`
}

// WebhookUpdate is the body of PATCH /events/webhooks/{id}: the fields
// given replace the webhook's.
type WebhookUpdate struct {
	Name            *string   `json:"name,omitempty"`
	URL             *string   `json:"url,omitempty"`
	Enabled         *bool     `json:"enabled,omitempty"`
	Events          *[]string `json:"events,omitempty"`
	SignatureSecret *string   `json:"signatureSecret,omitempty"`
}

// Webhook is a registered webhook as the API returns it (never with its
// signature secret). Deliveries is SPACE's own: the delivery state.
type Webhook struct {
	ID         string               `json:"id"`
	TeamID     string               `json:"teamId"`
	Name       string               `json:"name"`
	CreatedAt  time.Time            `json:"createdAt"`
	Enabled    bool                 `json:"enabled"`
	URL        string               `json:"url"`
	Events     []string             `json:"events"`
	Deliveries WebhookDeliveryState `json:"deliveries"`
}

// WebhookDeliveryState sums up a webhook's deliveries.
type WebhookDeliveryState struct {
	Pending   int        `json:"pending"`
	Delivered int64      `json:"delivered"`
	Failed    int64      `json:"failed"`
	LastAt    *time.Time `json:"lastAt,omitempty"`
	// LastStatus is the HTTP status of the last attempt (0: no answer).
	LastStatus int    `json:"lastStatus,omitempty"`
	LastError  string `json:"lastError,omitempty"`
	// RecentFailures are the last deliveries given up on, newest first.
	RecentFailures []FailedDelivery `json:"recentFailures,omitempty"`
}

// FailedDelivery is a delivery given up on after its last attempt.
type FailedDelivery struct {
	DeliveryID string    `json:"deliveryId"`
	EventID    string    `json:"eventId"`
	EventType  string    `json:"eventType"`
	Attempts   int       `json:"attempts"`
	LastError  string    `json:"lastError"`
	FailedAt   time.Time `json:"failedAt"`
}
