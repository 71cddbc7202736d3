-- Argo CD health of a kubellm.io LLMDeployment, from the status the operator writes.
-- Install: argocd-cm key resource.customizations.health.kubellm.io_LLMDeployment (docs/gitops.md).
-- It reads the status as kstatus (Flux, kpt) does, and never fails on a status of another shape: any field
-- may be missing or of another type (an older operator, a hand-edited object).
local hs = {}

local function field(t, key)
  if type(t) == "table" then
    return t[key]
  end
  return nil
end

local function text(v)
  if type(v) == "string" or type(v) == "number" then
    return tostring(v)
  end
  return nil
end

-- "reason: message", or whichever of the two is there.
local function explain(c, fallback)
  local reason, message = text(field(c, "reason")), text(field(c, "message"))
  if reason ~= nil and reason ~= "" and message ~= nil and message ~= "" then
    return reason .. ": " .. message
  end
  if message ~= nil and message ~= "" then
    return message
  end
  if reason ~= nil and reason ~= "" then
    return reason
  end
  return fallback
end

local function result(status, message)
  hs.status = status
  hs.message = message
  return hs
end

local metadata, status = field(obj, "metadata"), field(obj, "status")
local deleting = field(metadata, "deletionTimestamp")
if deleting ~= nil and deleting ~= false and deleting ~= "" then
  return result("Progressing", "being deleted")
end
if type(status) ~= "table" then
  return result("Progressing", "waiting for the operator to write a status")
end

-- A status written for another generation says nothing about this spec (no observedGeneration: no check).
local generation, observed = field(metadata, "generation"), field(status, "observedGeneration")
if type(generation) == "number" and type(observed) == "number" and observed ~= generation then
  return result("Progressing", "waiting for the operator to observe generation " .. tostring(generation))
end

local conditions = {}
if type(status.conditions) == "table" then
  for _, c in ipairs(status.conditions) do
    if type(c) == "table" then
      conditions[#conditions + 1] = c
    end
  end
end

-- kstatus's abnormal-true pair, in list order: the first True Reconciling or Stalled decides.
for _, c in ipairs(conditions) do
  if c.status == "True" and c.type == "Reconciling" then
    return result("Progressing", explain(c, "reconciling"))
  end
  if c.status == "True" and c.type == "Stalled" then
    return result("Degraded", explain(c, "stalled"))
  end
end

-- An operator older than Stalled says Degraded; kstatus ignores it, so it only explains a Ready that is not True.
local degraded = nil
for _, c in ipairs(conditions) do
  if c.type == "Degraded" and c.status == "True" then
    degraded = c
    break
  end
end

for _, c in ipairs(conditions) do
  if c.type == "Ready" and c.status == "True" then
    if c.reason == "ScaledToZero" then
      return result("Suspended", explain({message = c.message}, "scaled to zero replicas"))
    end
    return result("Healthy", explain({message = c.message}, "ready"))
  end
  if c.type == "Ready" and (c.status == "False" or c.status == "Unknown") then
    if degraded ~= nil then
      return result("Progressing", explain(degraded, "degraded"))
    end
    return result("Progressing", explain(c, "not ready"))
  end
end

-- kstatus reads a status without these conditions as current; Argo CD waits for the operator to say Ready.
return result("Progressing", "waiting for the Ready condition")
