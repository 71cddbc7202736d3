-- Argo CD health of a kubellm.io LLMDeployment, from the status the operator writes.
-- Install: argocd-cm key resource.customizations.health.kubellm.io_LLMDeployment (docs/gitops.md).
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

-- A status written for an older spec says nothing about this one.
local generation = obj.metadata.generation
if obj.status == nil or obj.status.observedGeneration == nil
    or (generation ~= nil and obj.status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready = condition("Ready")
local progressing = condition("Progressing")
local reconciling = condition("Reconciling")
-- Stalled (kstatus) says a human must act; a status from an operator older than it has Degraded only.
local stalled = condition("Stalled")
if stalled == nil then
  stalled = condition("Degraded")
end

if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.reason .. ": " .. (stalled.message or "")
  return hs
end
if ready ~= nil and ready.reason == "ScaledToZero" then
  hs.status = "Suspended"
  hs.message = ready.message or "scaled to zero replicas"
  return hs
end
local busy = (reconciling ~= nil and reconciling.status == "True") or (progressing ~= nil and progressing.status == "True")
if ready ~= nil and ready.status == "True" and not busy then
  hs.status = "Healthy"
  hs.message = ready.message or ""
  return hs
end
hs.status = "Progressing"
if reconciling ~= nil and reconciling.status == "True" then
  hs.message = reconciling.reason .. ": " .. (reconciling.message or "")
elseif progressing ~= nil and progressing.status == "True" then
  hs.message = progressing.message or progressing.reason
elseif ready ~= nil then
  hs.message = ready.message or ready.reason
else
  hs.message = "waiting for status"
end
return hs
